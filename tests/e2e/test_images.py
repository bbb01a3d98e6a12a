"""The images `make images` built (`make e2e`): the operator's is small and has no torch; the engine's serves
completions as uid 10001 on a read-only root with every capability dropped."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from tests.support.images import ENGINE_IMAGE, OPERATOR_IMAGE, require_images
from tests.support.node_agent import Podman
from tests.support.sidecar import http

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Podman:
    require_images()
    return Podman(tmp_path_factory.mktemp("podman"))


def test_the_operator_image_is_small_and_has_no_torch(podman):
    size = int(podman("image", "inspect", "--format", "{{.Size}}", OPERATOR_IMAGE))
    assert size < 600e6, f"the operator image is {size / 1e6:.0f} MB"
    probe = "import importlib.util as u; print(u.find_spec('torch') is None, u.find_spec('kopf') is not None)"
    out = podman("run", "--rm", "--entrypoint", "/opt/overlap/bin/python", OPERATOR_IMAGE, "-c", probe)
    assert out.split() == ["True", "True"]


def test_the_engine_image_serves_as_uid_10001_on_a_read_only_root(podman, tiny_model_dir):
    container = podman(
        "run", "--detach", "--user", "10001:10001", "--read-only", "--read-only-tmpfs=false",
        "--tmpfs", "/tmp:rw,size=512m", "--cap-drop", "all", "--security-opt", "no-new-privileges",
        "--volume", f"{tiny_model_dir}:/models/tiny:ro", ENGINE_IMAGE,
        "serve", "--model", "/models/tiny", "--host", "0.0.0.0", "--port", "8000",
    )  # fmt: skip
    try:
        ip = podman("inspect", "--format", "{{.NetworkSettings.IPAddress}}", container)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if http("GET", f"http://{ip}:8000/v1/models", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 8}
        status, _, reply = http("POST", f"http://{ip}:8000/v1/completions", body, timeout=60)
        assert status == 200 and reply["usage"]["completion_tokens"] == 8, reply
        assert podman("exec", container, "id", "-u") == "10001"
        touched = subprocess.run(["podman", "exec", container, "touch", "/opt/x"], capture_output=True, text=True,
                                 env=podman.env)  # fmt: skip
        assert touched.returncode != 0 and "Read-only file system" in touched.stderr
        caps = json.loads(podman("inspect", "--format", "{{json .EffectiveCaps}}", container))
        assert not caps
    finally:
        podman("rm", "--force", "--time", "2", container, check=False)
