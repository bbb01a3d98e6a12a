"""The repository's layout as a new user meets it: nothing at the root shadows the standard library, workers started
from the root import cleanly, and each component installs on its own (the operator without torch)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMPONENTS = ("engine", "openai", "sidecar", "gateway", "operator", "bench")
# The `overlap` subcommands each distribution adds (overlap-openai adds none: it is a library the sidecar and the router
# share).
COMMANDS = {
    "engine": "overlap-engine",
    "sidecar": "overlap-sidecar",
    "serve": "overlap-sidecar",
    "gateway": "overlap-gateway",
    "operator": "overlap-operator",
    "bench": "overlap-bench",
}
SAFE_PATH_VARIABLE = "PYTHON" + "SAFEPATH"  # spelled in two halves: the workaround scan below reads this file too


def _python_at_root(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -c CODE` from the repository root, where `-c` puts the current folder first on sys.path."""
    env = {k: v for k, v in os.environ.items() if k not in (SAFE_PATH_VARIABLE, "PYTHONPATH")}
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_a_fresh_import_of_operator_from_the_root_is_the_standard_librarys() -> None:
    out = _python_at_root(
        "import sys; sys.modules.pop('operator', None); import operator; operator.eq; print(operator.__file__)"
    )
    assert out.returncode == 0, out.stderr
    assert not out.stdout.strip().startswith(str(REPO)), out.stdout


def test_import_openai_from_the_root_is_the_client_library() -> None:
    """The root's openai/ folder (the overlap-openai component) is no package: `import openai` there still gets the
    OpenAI client, as `operator` gets the standard library's."""
    out = _python_at_root("import openai; print(openai.__file__, openai.OpenAI.__name__)")
    assert out.returncode == 0, out.stderr  # the client's OpenAI class is there
    assert not out.stdout.strip().startswith(str(REPO / "openai")), out.stdout  # (the venv may lie in the repo)


def test_no_top_level_folder_is_a_package() -> None:
    assert not [p for p in REPO.iterdir() if (p / "__init__.py").exists() and p.name != "tests"]


def test_a_spawn_worker_started_from_the_root_imports_cleanly() -> None:
    """A spawned child re-imports everything with the parent's sys.path (the root first): it must still get the
    standard library's `operator`, which multiprocessing itself needs, and the components."""
    code = (
        "import importlib, multiprocessing as mp\n"
        "ctx = mp.get_context('spawn')\n"
        "for name in ('overlap.engine', 'overlap.sidecar.app', 'overlap.operator.spec'):\n"
        "    p = ctx.Process(target=importlib.import_module, args=(name,)); p.start(); p.join(120)\n"
        "    print(name, p.exitcode)\n"
    )
    out = _python_at_root(code, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["overlap.engine", "0", "overlap.sidecar.app", "0", "overlap.operator.spec", "0"], (
        out.stdout + out.stderr
    )


def test_no_path_workarounds_remain_in_the_repo() -> None:
    """The layout needs none: no safe-path variable, no sys.path edits, no importlib import mode."""
    banned = re.compile(SAFE_PATH_VARIABLE + "|sys" + r"\.path\.(insert|append)|import-mode=" + "importlib")
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    hits = []
    for name in tracked.split():
        path = REPO / name
        if path.suffix in (".png", ".csv", ".jsonl") or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if banned.search(line):
                hits.append(f"{name}:{number}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_each_component_has_its_own_distribution_and_registers_its_commands() -> None:
    from importlib.metadata import entry_points

    from overlap.cli import COMMAND_GROUP

    registered = {e.name: e.dist.name for e in entry_points(group=COMMAND_GROUP)}
    assert registered == COMMANDS
    assert {p.parent.name for p in REPO.glob("*/pyproject.toml")} == set(COMPONENTS)
    for component in COMPONENTS:
        assert (REPO / component / "pyproject.toml").is_file()
        assert not (REPO / component / "src" / "overlap" / "__init__.py").exists(), "overlap must stay a namespace"


@pytest.mark.slow
def test_the_operator_the_gateway_and_the_sidecar_install_without_torch(tmp_path: Path) -> None:
    """A fresh venv with only the engine's base and the operator component, as the operator image has; then the
    gateway without the sidecar (what they share is overlap-openai); then the sidecar beside them, as the sidecar
    image has."""
    venv.create(tmp_path / "venv", with_pip=True)
    python, overlap = tmp_path / "venv" / "bin" / "python", tmp_path / "venv" / "bin" / "overlap"
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", REPO / "engine", REPO / "operator"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout + install.stderr
    has_torch = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True)
    assert has_torch.returncode != 0, "torch came in with the operator"
    modules = "overlap.operator.handlers, overlap.operator.control.loop, overlap.engine.serving.client, overlap.engine"
    imports = subprocess.run([python, "-c", f"import {modules}"], capture_output=True, text=True, timeout=120)
    assert imports.returncode == 0, imports.stderr
    help_out = subprocess.run([overlap, "operator", "--help"], capture_output=True, text=True, timeout=60)
    assert help_out.returncode == 0, help_out.stderr
    assert "--all-namespaces" in help_out.stdout
    commands = subprocess.run([overlap, "--help"], capture_output=True, text=True, timeout=60).stdout
    installed, _, missing = commands.partition("not installed here:")
    assert "operator" in installed and "sidecar" not in installed and "bench" not in installed
    assert "sidecar" in missing and "bench" in missing  # named with what installs them
    gateway = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", REPO / "openai", REPO / "gateway"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert gateway.returncode == 0, gateway.stdout + gateway.stderr
    imports = subprocess.run([python, "-c", "import overlap.gateway.router.app, overlap.sidecar"], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert "No module named 'overlap.sidecar'" in imports.stderr, imports.stderr
    assert subprocess.run([overlap, "router", "--help"], capture_output=True, timeout=60).returncode == 0
    sidecar = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", REPO / "sidecar"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert sidecar.returncode == 0, sidecar.stdout + sidecar.stderr
    imports = subprocess.run([python, "-c", "import overlap.sidecar.app, torch"], capture_output=True, text=True)
    assert "No module named 'torch'" in imports.stderr, imports.stderr
    assert subprocess.run([overlap, "sidecar", "--help"], capture_output=True, timeout=60).returncode == 0
