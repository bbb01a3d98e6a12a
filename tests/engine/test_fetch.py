"""`overlap model fetch` against loopback sources with faults (tests/support/model_sources.py): each case ends with
the right model or a clear error in the source's words, and nothing half-written where a model is read from."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from overlap.engine.delivery import adapters
from overlap.engine.delivery.fetch import fetch
from overlap.engine.delivery.sources import FetchError
from overlap.engine.delivery.uri import ModelURIError, parse
from tests.support.model_sources import FileServer, HubServer, MotoServer, RegistryProxy, RegistryServer
from tests.support.sidecar import Proc, child_env, overlap_cmd, wait_until

REPO_ID = "acme/tiny-chat"
WEIGHTS = os.urandom(3 << 20)
MODEL = {
    "config.json": b'{"model_type": "llama"}',
    "tokenizer.json": b'{"version": "1.0"}',
    "model.safetensors": WEIGHTS,
    "README.md": b"not part of a model folder",
}
FOLDER = {k: v for k, v in MODEL.items() if k != "README.md"}


@pytest.fixture(autouse=True)
def _quick(monkeypatch):
    monkeypatch.setenv("OVERLAP_FETCH_BACKOFF_S", "0.05")
    monkeypatch.delenv("HF_TOKEN", raising=False)


@pytest.fixture
def hub(monkeypatch):
    server = HubServer({REPO_ID: dict(MODEL)}).start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    yield server
    server.stop()


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
            and p.name != ".overlap-last-used"}  # fmt: skip


def _only_whole_models(cache: Path) -> list[Path]:
    """The models a reader could load: everything outside .partial and .locks."""
    return [p for p in cache.glob("hf/*/*") if p.is_dir()] + [p for p in cache.glob("s3/*/*/*") if p.is_dir()]


def test_uris_parse_or_say_what_is_wrong():
    assert parse("hf://Qwen/Qwen2.5-0.5B-Instruct@v1.0").revision == "v1.0"
    assert parse("s3://models/qwen/0.5b").path == "qwen/0.5b"
    assert parse("pvc://weights/llama").location == "weights" and not parse("pvc://weights/llama").fetched
    assert parse("https://h.example/m.tar.gz#sha256=" + "a" * 64).sha256 == "a" * 64
    image = parse("oci://ghcr.io:443/acme/qwen2.5-0.5b:v1@sha256:" + "b" * 64)
    assert (image.location, image.revision, image.sha256) == ("ghcr.io:443/acme/qwen2.5-0.5b", "v1", "b" * 64)
    assert parse("oci://localhost:5000/models/tiny").revision == "latest"
    for bad, words in [("ftp://x/y", "scheme"), ("hf://just-a-name", "hf://ORG/NAME"), ("hf://a/b@", "empty revision"),
                       ("https://h.example/model.bin", "archive"), ("s3://Bad_Bucket/x", "bucket"),
                       ("oci://qwen:v1", "registry named"), ("oci://ghcr.io/Acme/Qwen", "REPOSITORY")]:  # fmt: skip
        with pytest.raises(ModelURIError, match=words):
            parse(bad)


def test_a_hub_model_is_fetched_once_and_checked(hub, tmp_path):
    path, fetched = fetch(f"hf://{REPO_ID}", tmp_path, progress=lambda _: None)
    assert _files(path) == FOLDER  # what a model folder needs, not the README
    assert fetched == sum(len(v) for v in FOLDER.values())
    again, fetched_again = fetch(f"hf://{REPO_ID}@main", tmp_path, progress=lambda _: None)
    assert again == path and fetched_again == 0
    assert hub.gets[f"{REPO_ID}/model.safetensors"] == 1


@pytest.mark.parametrize("fault", ["stall", "5xx", "drop", "truncate"])
def test_a_hub_fault_mid_file_is_retried_and_resumed(hub, tmp_path, fault):
    hub.fault(f"{REPO_ID}/model.safetensors", fault)
    path, _ = fetch(f"hf://{REPO_ID}", tmp_path, stall_s=1, progress=lambda _: None)
    assert _files(path) == FOLDER
    if fault in ("stall", "drop"):  # resumed at the byte offset, not fetched again from the start
        assert hub.sent < sum(len(v) for v in FOLDER.values()) + len(WEIGHTS)


def test_a_wrong_hash_is_an_error_and_leaves_no_model(hub, tmp_path):
    hub.fault(f"{REPO_ID}/model.safetensors", "corrupt")
    with pytest.raises(FetchError, match=r"model\.safetensors: sha256 \w+ does not match the hub's"):
        fetch(f"hf://{REPO_ID}", tmp_path, progress=lambda _: None)
    assert _only_whole_models(tmp_path) == []


def test_a_401_is_an_error_in_the_hubs_words(monkeypatch, tmp_path):
    server = HubServer({REPO_ID: dict(MODEL)}, token="hf_right").start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    try:
        monkeypatch.setenv("HF_TOKEN", "hf_wrong")
        with pytest.raises(FetchError, match="401"):
            fetch(f"hf://{REPO_ID}", tmp_path, progress=lambda _: None)
        monkeypatch.setenv("HF_TOKEN", "hf_right")
        path, _ = fetch(f"hf://{REPO_ID}", tmp_path, progress=lambda _: None)
        assert _files(path) == FOLDER
    finally:
        server.stop()


def test_a_missing_repository_or_revision_says_so(hub, tmp_path):
    with pytest.raises(FetchError, match="404"):
        fetch("hf://acme/nothing-here", tmp_path, progress=lambda _: None)
    with pytest.raises(FetchError, match="404"):
        fetch(f"hf://{REPO_ID}@no-such-branch", tmp_path, progress=lambda _: None)


def test_two_fetches_at_once_download_it_once(hub, tmp_path):
    hub.fault(f"{REPO_ID}/model.safetensors", "stall")  # holds the first fetch mid-file while the second arrives
    cmd = overlap_cmd("model", "fetch", f"hf://{REPO_ID}", "--cache-dir", str(tmp_path), "--stall-s", "2")
    env = {**os.environ, "HF_ENDPOINT": hub.url, "OVERLAP_FETCH_BACKOFF_S": "0.05"}
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert outputs[0][0] == outputs[1][0]  # the same folder
    assert _files(Path(outputs[0][0].strip())) == FOLDER
    assert any("another fetch of it is under way" in err for _, err in outputs), outputs
    assert hub.sent < 2 * len(WEIGHTS)  # fetched once (the stalled half resumed, not twice over)


def test_the_command_prints_the_folder_or_writes_the_reason_for_the_pod_status(hub, tmp_path):
    link = tmp_path / "model" / "current"
    done = subprocess.run(overlap_cmd("model", "fetch", f"hf://{REPO_ID}", "--cache-dir", str(tmp_path / "cache"),
                                      "--link", str(link)), env={**os.environ, "HF_ENDPOINT": hub.url},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert link.resolve() == Path(done.stdout.strip()) and (link / "config.json").exists()
    assert "fetched 0.00 GB" in done.stderr or "GB in" in done.stderr
    log = tmp_path / "termination-log"
    log.touch()
    failed = subprocess.run(overlap_cmd("model", "fetch", "hf://acme/missing", "--cache-dir", str(tmp_path / "cache"),
                                        "--termination-log", str(log)), env={**os.environ, "HF_ENDPOINT": hub.url},
                            capture_output=True, text=True, timeout=120)  # fmt: skip
    assert failed.returncode == 1 and "404" in failed.stderr
    assert "hf://acme/missing" in log.read_text() and "404" in log.read_text()


def test_a_model_and_its_draft_are_fetched_by_one_command_and_the_eviction_keeps_both(monkeypatch, tmp_path):
    """`overlap model fetch URI --draft URI`, as the pod's fetch container runs it for a draft_model spec: both into
    the cache behind their links, an older model evicted, neither of the two; a draft that fails says so."""
    draft = {"config.json": b'{"model_type": "llama"}', "model.safetensors": os.urandom(1 << 20)}
    hub = HubServer({REPO_ID: dict(MODEL), "acme/tiny-draft": draft, "acme/old": dict(draft)}).start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    try:
        cache, links = tmp_path / "cache", tmp_path / "links"
        old, _ = fetch("hf://acme/old", cache, progress=lambda _: None)
        command = lambda draft_uri: overlap_cmd(  # noqa: E731
            "model", "fetch", f"hf://{REPO_ID}", "--link", str(links / "current"), "--draft", draft_uri,
            "--draft-link", str(links / "draft"), "--cache-dir", str(cache), "--max-cache-gb", "0.001",
            "--termination-log", str(tmp_path / "termination-log"))  # fmt: skip
        done = subprocess.run(command("hf://acme/tiny-draft"), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert _files(links / "current") == FOLDER and _files(links / "draft") == draft
        assert done.stdout.split() == [str((links / "current").resolve()), str((links / "draft").resolve())]
        assert not old.exists() and f"evicted {old.relative_to(cache).as_posix()}" in done.stderr

        log = tmp_path / "termination-log"
        log.touch()
        failed = subprocess.run(command("hf://acme/missing"), capture_output=True, text=True, timeout=120)
        assert failed.returncode == 1
        assert log.read_text().startswith("draft model: ") and "hf://acme/missing" in log.read_text()
    finally:
        hub.stop()


def _archive(files: dict[str, bytes], prefix: str = "tiny-chat/") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{prefix}{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_an_archive_over_http_resumes_after_a_drop_and_checks_its_hash(tmp_path):
    archive = _archive(FOLDER)
    server = FileServer({"tiny-chat.tar.gz": archive}).start()
    try:
        server.fault("tiny-chat.tar.gz", "drop")
        uri = f"{server.url}/tiny-chat.tar.gz#sha256={hashlib.sha256(archive).hexdigest()}"
        path, _ = fetch(uri, tmp_path, stall_s=2, progress=lambda _: None)
        assert _files(path) == FOLDER
        assert server.sent < 2 * len(archive)
        wrong = f"{server.url}/tiny-chat.tar.gz#sha256={'0' * 64}"
        with pytest.raises(FetchError, match="does not match the uri's"):
            fetch(wrong, tmp_path / "other", progress=lambda _: None)
    finally:
        server.stop()


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    server = MotoServer(tmp_path_factory.mktemp("moto"))
    yield server
    server.stop()


def test_a_bucket_prefix_is_fetched_once_and_a_missing_bucket_says_so(moto, tmp_path, monkeypatch):
    from minio import Minio

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    client = Minio(moto.url.removeprefix("http://"), access_key="test", secret_key="test", secure=False)
    client.make_bucket("models")
    for name, data in FOLDER.items():
        client.put_object("models", f"acme/tiny-chat/{name}", io.BytesIO(data), len(data))
    path, fetched = fetch("s3://models/acme/tiny-chat", tmp_path, progress=lambda _: None)
    assert _files(path) == FOLDER and fetched == sum(len(v) for v in FOLDER.values())
    assert fetch("s3://models/acme/tiny-chat", tmp_path, progress=lambda _: None) == (path, 0)
    with pytest.raises(FetchError, match=r"NoSuchBucket|does not exist"):
        fetch("s3://no-such-bucket/x", tmp_path, progress=lambda _: None)


# ---- OCI registries: Debian's docker-registry, faults from a proxy in front of it ------------------------------
@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    server = RegistryServer(tmp_path_factory.mktemp("registry"))
    yield server
    server.stop()


def _push_image(host: str, reference: str, folder: Path, layers: list[dict[str, bytes]]) -> dict:
    """An image as a container tool pushes one (tar+gzip layers of `files` at their paths in the image, no
    titles), through ORAS's blob and manifest uploads; the manifest comes back."""
    from oras.provider import Registry

    client = Registry(hostname=host, insecure=True)
    container = client.get_container(f"{host}/{reference}")

    def blob(data: bytes, media_type: str) -> dict:
        path = folder / hashlib.sha256(data).hexdigest()
        path.write_bytes(data)
        descriptor = {"mediaType": media_type, "digest": f"sha256:{path.name}", "size": len(data)}
        client.upload_blob(str(path), container, descriptor).raise_for_status()
        return descriptor

    descriptors = [blob(_archive(files, prefix=""), "application/vnd.oci.image.layer.v1.tar+gzip") for files in layers]
    config = blob(b'{"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers"}}',
                  "application/vnd.oci.image.config.v1+json")  # fmt: skip
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json", "config": config,
                "layers": descriptors}  # fmt: skip
    client.upload_manifest(manifest, container).raise_for_status()
    return manifest


def _push_files(host: str, reference: str, files: list[Path]) -> None:
    """`oras push REF FILE...`: an artifact of one layer per file, each named by its title."""
    from oras.provider import Registry

    Registry(hostname=host, insecure=True).push(target=f"{host}/{reference}", files=[str(f) for f in files],
                                                disable_path_validation=True, quiet=True)  # fmt: skip


def test_a_model_image_is_unpacked_with_its_whiteouts_and_resumed_after_faults(registry, tmp_path, monkeypatch):
    """A ModelCar-style image (the model under /models, a second layer replacing and deleting files of the
    first) from the real registry, through a proxy that stalls one layer and drops the other mid-stream."""
    base = {"models/model.safetensors": b"an older export", "models/old.bin": b"gone in layer 2",
            "models/config.json": FOLDER["config.json"], "models/tokenizer.json": FOLDER["tokenizer.json"],
            "etc/os-release": b"ID=scratch"}  # fmt: skip
    update = {"models/.wh.old.bin": b"", "models/model.safetensors": WEIGHTS}
    manifest = _push_image(registry.host, "acme/tiny-chat:v1", tmp_path, [base, update])
    proxy = RegistryProxy(registry).start()
    monkeypatch.setenv("OVERLAP_OCI_PLAIN_HTTP", proxy.host)
    try:
        proxy.fault(manifest["layers"][0]["digest"], "stall")
        proxy.fault(manifest["layers"][1]["digest"], "drop", "5xx")
        path, _ = fetch(f"oci://{proxy.host}/acme/tiny-chat:v1", tmp_path / "cache", stall_s=1,
                              progress=lambda _: None)  # fmt: skip
        assert _files(path) == FOLDER
        assert proxy.sent < 1.5 * sum(layer["size"] for layer in manifest["layers"])  # resumed, not fetched again
        assert fetch(f"oci://{proxy.host}/acme/tiny-chat:v1", tmp_path / "cache", progress=lambda _: None) == (path, 0)
    finally:
        proxy.stop()


def test_an_oras_artifact_is_fetched_by_digest_and_a_wrong_digest_or_tag_says_so(registry, tmp_path, monkeypatch):
    """An ORAS artifact (one file per layer, named by its title) pinned by its manifest's digest."""
    monkeypatch.setenv("OVERLAP_OCI_PLAIN_HTTP", registry.host)
    for name, data in FOLDER.items():
        (tmp_path / name).write_bytes(data)
    _push_files(registry.host, "acme/artifact:v1", [tmp_path / name for name in FOLDER])
    from oras.provider import Registry

    digest = Registry(insecure=True).do_request(
        f"http://{registry.host}/v2/acme/artifact/manifests/v1", "HEAD",
        headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
    ).headers["Docker-Content-Digest"]  # fmt: skip
    path, _ = fetch(f"oci://{registry.host}/acme/artifact@{digest}", tmp_path / "cache", progress=lambda _: None)
    assert _files(path) == FOLDER and digest.replace(":", "-") in path.name
    for missing in (f"acme/artifact:v1@sha256:{'0' * 64}", "acme/artifact:v2", "acme/nothing:v1"):
        with pytest.raises(FetchError, match="404 Client Error"):
            fetch(f"oci://{registry.host}/{missing}", tmp_path / "cache", progress=lambda _: None)


def test_a_damaged_blob_in_the_registry_is_an_error_and_leaves_no_model(registry, tmp_path, monkeypatch):
    monkeypatch.setenv("OVERLAP_OCI_PLAIN_HTTP", registry.host)
    models = {f"models/{name}": data for name, data in FOLDER.items()}
    manifest = _push_image(registry.host, "acme/damaged:v1", tmp_path, [models])
    blob = registry.blob_file(manifest["layers"][0]["digest"])
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(FetchError, match="hash to sha256:"):
        fetch(f"oci://{registry.host}/acme/damaged:v1", tmp_path / "cache", progress=lambda _: None)
    assert not list((tmp_path / "cache").glob("oci/*/*/*/*"))


@pytest.mark.parametrize("python_has_the_data_filter", [True, False])
def test_an_archive_that_leaves_the_model_folder_is_refused(tmp_path, monkeypatch, python_has_the_data_filter):
    """With tarfile's `data` filter, and with the checks that stand in for it on Pythons before 3.11.4 (the
    images' Debian Python)."""
    if not python_has_the_data_filter:
        monkeypatch.delattr(tarfile, "data_filter")
    good = _archive(FOLDER)
    evil = _archive({"../outside.txt": b"x"}, prefix="")
    server = FileServer({"good.tar.gz": good, "evil.tar.gz": evil}).start()
    try:
        path, _ = fetch(f"{server.url}/good.tar.gz", tmp_path / "cache", progress=lambda _: None)
        assert _files(path) == FOLDER
        with pytest.raises(FetchError, match=r"outside\.txt: leaves the model folder"):
            fetch(f"{server.url}/evil.tar.gz", tmp_path / "cache", progress=lambda _: None)
        assert not (tmp_path / "cache" / "outside.txt").exists() and not (tmp_path / "outside.txt").exists()
    finally:
        server.stop()


def test_adapters_are_fetched_behind_links_named_for_their_uri_and_one_bad_uri_holds_up_no_other(monkeypatch, tmp_path):
    """`overlap model fetch-adapters`, as the pod's adapters container runs it: each listed adapter fetched and
    linked, a failing one reported while the others arrive, a removed one's link gone, a changed uri a new link."""
    config = b'{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}'
    repos = {repo: {"adapter_config.json": config, "adapter_model.safetensors": os.urandom(4096)}
             for repo in ("acme/sql-lora", "acme/chat-lora")}  # fmt: skip
    hub = HubServer(repos).start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    try:
        cache, links, listed = tmp_path / "cache", tmp_path / "links", tmp_path / "adapters.json"
        wanted = {"sql": "hf://acme/sql-lora", "chat": "hf://acme/chat-lora", "gone": "hf://acme/missing-lora"}
        listed.write_text(json.dumps(wanted))
        command = overlap_cmd(
            "model", "fetch-adapters", str(listed), "--cache-dir", str(cache), "--link-dir", str(links)
        )
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and "adapter gone: error:" in done.stderr and "404" in done.stderr
        for name in ("sql", "chat"):
            assert _files(links / adapters.link_name(name, wanted[name])) == repos[wanted[name][5:]]
        assert not (links / adapters.link_name("gone", wanted["gone"])).exists()

        # --watch, as the pod runs it: a changed list (chat removed, sql from another repository) is acted on
        watcher = Proc([*command, "--watch", "--interval-s", "0.2"], tmp_path / "watch.log",
                       env={**child_env(), "HF_ENDPOINT": hub.url})  # fmt: skip
        try:
            changed = {"sql": "hf://acme/chat-lora"}
            wait_until(lambda: "adapter gone: error:" in watcher.log_path.read_text(), 60, "the first sync", watcher)
            listed.write_text(json.dumps(changed))
            wanted_links = [adapters.link_name("sql", changed["sql"])]
            wait_until(lambda: sorted(p.name for p in links.iterdir()) == wanted_links, 60, "the list's change",
                       watcher)  # fmt: skip
            assert _files(links / wanted_links[0]) == repos["acme/chat-lora"]
        finally:
            watcher.stop()
    finally:
        hub.stop()
