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
_ORDER = ("engine", "sidecar", "serve", "gateway", "operator", "bench")
# Each component's subcommands (its entry point is named after it) and what installs it, so that a known command
# whose component is not installed (`make run` installs only the engine and the sidecar) is named, not refused as
# an "invalid choice".
COMPONENT_COMMANDS = {
    "engine": ("engine", "model"),
    "sidecar": ("sidecar",),
    "serve": ("serve",),  # the laptop launcher, overlap.serve: in the sidecar's distribution, with its extra
    "gateway": ("activator", "router"),
    "operator": ("operator",),
    "bench": ("bench",),
}
# The folders `pip install -e` takes for each: the component's own last, after the other components it depends on,
# which no package index has (the engine is there wherever `overlap` runs).
_PIP_TARGETS = {
    "engine": ("'engine[model]'",),
    "sidecar": ("openai", "sidecar"),
    "serve": ("openai", "'sidecar[serve]'"),
    "gateway": ("openai", "gateway"),
    "operator": ("operator",),
    "bench": ("openai", "sidecar", "gateway", "operator", "bench"),
}


def pip_command(component: str) -> str:
    return "pip install " + " ".join(f"-e {target}" for target in _PIP_TARGETS[component])


def _install_hint(component: str) -> str:
    distribution = "overlap-" + _PIP_TARGETS[component][-1].strip("'").split("[")[0]
    return (f"the {component} component ({distribution}): `make venv` installs every component, or "
            f"`{pip_command(component)}` from the repository's root")  # fmt: skip


def missing_commands(installed: set[str]) -> dict[str, str]:
    """The known subcommands whose component is not among `installed` (entry-point names), each with its
    component."""
    return {command: component for component, commands in COMPONENT_COMMANDS.items() if component not in installed
            for command in commands}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="overlap", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    found = entry_points(group=COMMAND_GROUP)
    for entry in sorted(found, key=lambda e: (_ORDER.index(e.name) if e.name in _ORDER else len(_ORDER), e.name)):
        entry.load()(subparsers)
    parser.missing_commands = missing_commands({entry.name for entry in found})
    if parser.missing_commands:
        missing = "; ".join(f"{', '.join(COMPONENT_COMMANDS[component])} (`{pip_command(component)}`)"
                            for component in dict.fromkeys(parser.missing_commands.values()))  # fmt: skip
        parser.epilog = f"not installed here: {missing}, from the repository's root; `make venv` installs them all"
    return parser


def _command_word(argv: list[str]) -> str | None:
    """The subcommand argv names: its first word that is no option (nor --log-level's value)."""
    words = iter(argv)
    for word in words:
        if word == "--":
            return next(words, None)
        if word.startswith("-"):
            name = word.split("=", 1)[0]
            if "=" not in word and len(name) > 2 and "--log-level".startswith(name):
                next(words, None)  # its value
            continue
        return word
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    command = _command_word(argv)
    if command in parser.missing_commands:
        print(f"overlap: error: `overlap {command}` is not installed here: it comes with "
              f"{_install_hint(parser.missing_commands[command])}", file=sys.stderr)  # fmt: skip
        return 2
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
