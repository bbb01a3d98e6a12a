"""The one `overlap` console command.

Each installed component registers its own subcommands through the `overlap.commands` entry-point group (a
`register(subparsers)` function in its `cli.py`), so `overlap` offers what is installed: the operator image has
`overlap operator`, the dev venv everything. Registration must stay cheap: heavy imports (torch, kopf) happen
inside the handlers.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import signal
import sys
from importlib.metadata import entry_points

from overlap.engine.errors import OverlapError

COMMAND_GROUP = "overlap.commands"
# The order `overlap --help` lists the components in; others follow by name.
_ORDER = ("engine", "sidecar", "operator", "bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="overlap", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    found = entry_points(group=COMMAND_GROUP)
    for entry in sorted(found, key=lambda e: (_ORDER.index(e.name) if e.name in _ORDER else len(_ORDER), e.name)):
        entry.load()(subparsers)
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
