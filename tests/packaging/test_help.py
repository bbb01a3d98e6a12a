"""Every `overlap ...` command's --help runs and says something: a help text argparse cannot format (a bare `%`)
fails here, not in front of a newcomer."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from overlap.cli import build_parser


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


COMMANDS = list(_commands(build_parser()))


def test_the_walk_finds_the_commands_the_readme_names():
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"serve", "engine", "sidecar", "operator", "activator", "model build-tiny", "bench engine",
            "bench http", "bench control", "bench replay"} <= names  # fmt: skip


@pytest.mark.parametrize("path", [path for path, _ in COMMANDS], ids=lambda p: " ".join(p) or "overlap")
def test_help_runs(path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*path, "--help"])
    assert exited.value.code == 0
    assert out.getvalue().startswith("usage: overlap"), out.getvalue()[:200]
