"""The one `overlap` console command.

Each package registers its own subcommands (`register(subparsers)` in its `cli.py`), so this file stays a
table of contents. Registration must stay cheap: heavy imports (torch, kopf) happen inside the handlers.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import logging
import signal
import sys

from overlap.engine.errors import OverlapError

# (module, what it adds) in the order `overlap --help` lists them.
_COMMAND_MODULES = (
    "overlap.engine.cli",  # overlap model ..., overlap engine
    "overlap.sidecar.cli",  # overlap sidecar, overlap serve
    "overlap.operator.cli",  # overlap operator
    "overlap.bench.cli",  # overlap bench ...
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="overlap", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a package without a cli.py yet
            if exc.name != name:
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with contextlib.suppress(ValueError, OSError):  # stderr without a file descriptor (captured): skip
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints where every thread is
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except OverlapError as exc:  # the caller's mistake: a clear message, no traceback
        print(f"overlap: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
