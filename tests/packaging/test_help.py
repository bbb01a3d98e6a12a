"""Every `overlap ...` command's --help runs and says something: a help text argparse cannot format (a bare `%`)
fails here, not in front of a newcomer."""

from __future__ import annotations

import argparse
import contextlib
import io
import tomllib
from pathlib import Path

import pytest

from overlap.cli import build_parser


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))


COMMANDS = list(_commands(build_parser()))
REPO = Path(__file__).resolve().parents[2]


def test_the_walk_finds_the_commands_the_readme_names():
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"serve", "engine", "sidecar", "operator", "activator", "router", "model build-tiny", "bench engine",
            "bench http", "bench control", "bench replay"} <= names  # fmt: skip


@pytest.mark.parametrize("path", [path for path, _ in COMMANDS], ids=lambda p: " ".join(p) or "overlap")
def test_help_runs(path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        build_parser().parse_args([*path, "--help"])
    assert exited.value.code == 0
    assert out.getvalue().startswith("usage: overlap"), out.getvalue()[:200]


def test_the_table_of_each_components_commands_is_what_they_register():
    """`overlap` names the component of a command that is not installed from this table: it must not drift."""
    from overlap.cli import COMPONENT_COMMANDS

    top = {path[0] for path, _ in COMMANDS if len(path) == 1}
    assert top == {command for commands in COMPONENT_COMMANDS.values() for command in commands}


def test_a_known_command_of_a_component_not_installed_says_what_installs_it(monkeypatch, capsys):
    """After `make run` (the engine and the sidecar only), `overlap bench engine` names what brings `bench` instead
    of argparse's "invalid choice"; exit code 2, as for any usage error."""
    import overlap.cli as cli

    served = [e for e in cli.entry_points(group=cli.COMMAND_GROUP) if e.name in ("engine", "sidecar", "serve")]
    monkeypatch.setattr(cli, "entry_points", lambda group: served)
    for argv, command, component in ((["bench", "engine", "--quick"], "bench", "bench"),
                                     (["--log-level", "DEBUG", "operator"], "operator", "operator"),
                                     (["--log-level=DEBUG", "bench", "--help"], "bench", "bench"),
                                     (["router", "--help"], "router", "gateway")):  # fmt: skip
        assert cli.main(argv) == 2
        error = capsys.readouterr().err
        assert f"`overlap {command}` is not installed here" in error, error
        assert f"overlap-{component}" in error and "make venv" in error and cli.pip_command(component) in error
        assert "invalid choice" not in error
    parser = cli.build_parser()
    assert "bench" in parser.format_help() and "make venv" in parser.format_help()  # `overlap --help` names them
    with pytest.raises(SystemExit) as exited:  # an unknown command is still argparse's error
        cli.main(["benhc"])
    assert exited.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_each_pip_hint_names_the_components_its_distribution_needs():
    """`pip install -e bench` alone fails on a fresh machine: overlap-operator, overlap-gateway, ... are on no package
    index. The hint names every component a distribution depends on (the engine is installed where `overlap` runs)."""
    from overlap.cli import COMPONENT_COMMANDS, pip_command

    for component in COMPONENT_COMMANDS:
        folder = "sidecar" if component == "serve" else component
        project = tomllib.loads((REPO / folder / "pyproject.toml").read_text())["project"]
        needed = [d for d in project["dependencies"] if d.startswith("overlap-") and not d.startswith("overlap-engine")]
        for dependency in needed:
            name = dependency.split("==")[0].split("[")[0].removeprefix("overlap-")
            assert f"-e {name}" in pip_command(component), (component, dependency)
