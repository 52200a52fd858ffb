"""Errors rlt raises on bad input. Each message says what to change."""


class RltError(Exception):
    """Base of rlt's user-facing errors."""


class InvalidRequestError(RltError, ValueError):
    """A request (prompt or sampling parameters) cannot be served; nothing was admitted.

    ``param`` names the request field the error is about (``prompt``, ``max_tokens``,
    ``max_loops``, ...), as the OpenAI error shape's ``param``; None when no one field is at fault.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class CheckpointError(RltError):
    """A checkpoint directory is missing, malformed or does not match its config."""


class ConfigError(RltError, ValueError):
    """An engine option is out of range or inconsistent."""
