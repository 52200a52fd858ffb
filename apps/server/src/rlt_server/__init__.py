"""rlt-server: the thin app that composes whatever rlt packages are installed.

Subcommands: ``generate`` (offline, stdout JSON lines) and ``serve`` (OpenAI-compatible HTTP,
needs rlt-serve). The app holds no engine logic: it parses flags, builds an ``EngineConfig``,
composes features through ``rlt.platform.features`` and runs.
"""
