"""Errors rlt raises on bad input. Each message says what to change."""


class RltError(Exception):
    """Base of rlt's user-facing errors."""


class InvalidRequestError(RltError, ValueError):
    """A request (prompt or sampling parameters) cannot be served; nothing was admitted."""


class CheckpointError(RltError):
    """A checkpoint directory is missing, malformed or does not match its config."""


class ConfigError(RltError, ValueError):
    """An engine option is out of range or inconsistent."""
