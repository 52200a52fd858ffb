"""Entry point of ``rlt-server``: subcommand dispatch. Each subcommand lives in its own module and
registers itself with ``add_parser(subparsers)``."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from rlt_server.common import run_guarded

#: Subcommand modules; a module whose package is not installed is skipped (its feature is absent).
SUBCOMMANDS = ("rlt_server.generate", "rlt_server.serve")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's default prints usage too)
        self.exit(2, f"rlt-server: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rlt-server", description="rlt: serving runtime for looped language models")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("rlt_server"):
                continue
            raise
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return run_guarded(lambda: args.run(args))


if __name__ == "__main__":
    sys.exit(main())
