"""The images `make images` builds, and a skip for tests that need them."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.support.cluster import KUBECTL, REPO

HELM = REPO / ".tools" / "bin" / "helm"
VERSION = yaml.safe_load((REPO / "charts" / "overlap" / "Chart.yaml").read_text())["appVersion"]
ENGINE_IMAGE = f"ghcr.io/overlap-dev/overlap:{VERSION}"
OPERATOR_IMAGE = f"ghcr.io/overlap-dev/overlap-operator:{VERSION}"


def require_images() -> None:
    """Skip unless podman, both images, kubectl and helm are here (`make e2e` builds and fetches them first)."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed: run `make images`")
    for image in (ENGINE_IMAGE, OPERATOR_IMAGE):
        if subprocess.run(["podman", "image", "exists", image]).returncode != 0:
            pytest.skip(f"{image} is not built: run `make images`")
    if not (KUBECTL.exists() and HELM.exists()):
        pytest.skip("kubectl/helm are not in .tools/bin: run `make tools`")
