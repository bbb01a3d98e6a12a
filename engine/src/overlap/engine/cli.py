"""`overlap model ...` and `overlap engine`: the engine package's subcommands."""

from __future__ import annotations

import argparse

from overlap.engine.config import add_engine_flags, engine_overrides


def register(subparsers) -> None:
    model = subparsers.add_parser("model", help="build or inspect models")
    model_sub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    build = model_sub.add_parser("build-tiny", help="build the tiny default Llama model (fixed seed) into DIR")
    build.add_argument("dir", nargs="?", help="target folder (default: the cache folder used by `overlap serve`)")
    build.add_argument("--force", action="store_true", help="rebuild even if DIR already holds the model")
    build.set_defaults(func=_build_tiny)
    shape = model_sub.add_parser(
        "build-shape",
        help="build a random-weight model of a real family's shape (config, vocabulary; no download) into the cache",
    )
    shape.add_argument("name", help="the shape: " + ", ".join(_shape_names()))
    shape.add_argument("--quantization", choices=_quant_schemes(),
                       help="write the decoder's projections in that scheme, as its producer writes it (random "
                       "codes): w4a16, w8a8 and fp8 as llm-compressor's compressed-tensors schemes, fp8-block as the "
                       "DeepSeek-V3 / Qwen3 FP8 releases (128x128 block scales)")  # fmt: skip
    shape.add_argument("--layers", type=int, help="keep the first N decoder layers (the real widths, less depth: a "
                       "model too large for this machine's memory, e.g. qwen3-30b-a3b --layers 4)")  # fmt: skip
    shape.set_defaults(func=_build_shape)
    fetch = model_sub.add_parser(
        "fetch",
        help="fetch a model (hf://, s3://, gs://, https:// archive, oci://), and its speculative draft if asked, "
        "into the cache once, checked; print each folder",
        description="Fetch a model into the cache: parallel downloads that resume after a drop or a stall, every "
        "file checked against the source's hash, moved into place only when whole. A second fetch of the same "
        "version finds it there; two at once take turns. Credentials as the source's library reads them "
        "(HF_TOKEN, HF_ENDPOINT; AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL; a registry's login in "
        "DOCKER_CONFIG's config.json, OVERLAP_OCI_PLAIN_HTTP for registries without TLS); --draft's with the same "
        "credentials.",
    )
    fetch.add_argument("uri", nargs="?", help="hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, "
                       "https://HOST/PATH.tar[.gz][#sha256=HEX], "
                       "oci://REGISTRY/REPOSITORY[:TAG][@sha256:DIGEST]; may be left out with --draft")  # fmt: skip
    fetch.add_argument("--cache-dir", help="the cache folder (default: OVERLAP_MODEL_CACHE, else models/ in the cache)")
    fetch.add_argument("--link", help="make LINK a symlink to the model's folder (what the engine's --model reads)")
    fetch.add_argument("--draft", metavar="URI", help="also fetch a speculative draft model, after the model (the "
                       "eviction keeps both; a failure's reason starts with 'draft model: ')")  # fmt: skip
    fetch.add_argument("--draft-link", help="make DRAFT_LINK a symlink to the draft's folder")
    fetch.add_argument("--stall-s", type=float, default=30.0, help="a read that waits this long is a stall: retried")
    fetch.add_argument("--max-cache-gb", type=float, help="evict least recently used models above this size")
    fetch.add_argument(
        "--termination-log", default="/dev/termination-log", help="a failure's reason, for the pod status"
    )
    fetch.set_defaults(func=_fetch)
    adapters = model_sub.add_parser(
        "fetch-adapters",
        help="fetch the LoRA adapters a JSON file lists ({name: uri}) as `fetch` does, each behind a link in LINK_DIR",
        description="Fetch each adapter of LIST (a JSON object of name -> uri, the uris `fetch` takes) into the "
        "cache, and make LINK_DIR/NAME-HASH (HASH: of the uri) a link to it; links of adapters no longer listed are "
        "removed. An adapter that fails is reported and retried with --watch; the others are fetched. Credentials "
        "as `fetch` reads them.",
    )
    adapters.add_argument("list", help="the JSON file of name -> uri (the pod's adapters ConfigMap)")
    adapters.add_argument("--cache-dir", required=True, help="the cache folder")
    adapters.add_argument("--link-dir", required=True, help="the folder of the adapters' links")
    adapters.add_argument("--watch", action="store_true", help="keep running: fetch again when LIST changes")
    adapters.add_argument("--interval-s", type=float, default=10.0, help="with --watch: how often LIST is read")
    adapters.set_defaults(func=_fetch_adapters)

    engine = subparsers.add_parser(
        "engine",
        help="run the engine process alone, serving token ids on a Unix socket (the pod's engine container)",
    )
    engine.add_argument("--socket", required=True, help="Unix socket path to listen on")
    engine.add_argument("--config", help="JSON or YAML file of EngineConfig fields (snake_case)")
    engine.add_argument("--model", help="local Hugging Face model folder (default: the tiny default model)")
    engine.add_argument("--served-model-name", help="model name announced to the sidecar (default: the folder's name)")
    add_engine_flags(engine)
    engine.set_defaults(func=_run_engine)


def _build_tiny(args: argparse.Namespace) -> int:
    from overlap.engine.model.builder import build_tiny_model, default_model_dir

    path = build_tiny_model(args.dir or default_model_dir(), force=args.force)
    print(path)
    return 0


def _shape_names() -> list[str]:
    from overlap.engine.model.shapes import SHAPES

    return list(SHAPES)


def _quant_schemes() -> list[str]:
    from overlap.engine.model.shapes import QUANT_SCHEMES

    return list(QUANT_SCHEMES)


def _build_shape(args: argparse.Namespace) -> int:
    import sys

    from overlap.engine.model.shapes import ensure_shape_model

    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    print(ensure_shape_model(args.name, progress=progress, quantization=args.quantization, layers=args.layers))
    return 0


def _fetch(args: argparse.Namespace) -> int:
    import os
    import sys
    from pathlib import Path

    from overlap.engine.delivery.fetch import fetch
    from overlap.engine.delivery.sources import FetchError
    from overlap.engine.model.builder import cache_root

    cache_dir = args.cache_dir or os.environ.get("OVERLAP_MODEL_CACHE") or cache_root() / "models"
    max_bytes = int(args.max_cache_gb * 1e9) if args.max_cache_gb else None
    # (what a failure's reason starts with, uri, link): the model, then its draft
    wanted = [("", args.uri, args.link)] if args.uri else []
    if args.draft:
        wanted.append(("draft model: ", args.draft, args.draft_link))
    if not wanted:
        print("overlap model fetch: error: give a URI, --draft URI, or both", file=sys.stderr)
        return 2
    fetched: list[Path] = []
    for number, (what, uri, link) in enumerate(wanted, 1):
        try:
            # one eviction, after the last fetch: it keeps every folder this command fetched
            path, _ = fetch(uri, cache_dir, link=link, stall_s=args.stall_s,
                            max_cache_bytes=max_bytes if number == len(wanted) else None, keep=fetched,
                            progress=lambda line: print(line, file=sys.stderr, flush=True))  # fmt: skip
        except FetchError as exc:
            print(f"overlap model fetch: error: {what}{exc}", file=sys.stderr)
            log = Path(args.termination_log)
            if log.exists():
                log.write_text(f"{what}{exc}"[:4000])  # kubelet's limit is 4096 bytes
            return 1
        fetched.append(path)
        print(path)
    return 0


def _fetch_adapters(args: argparse.Namespace) -> int:
    import sys

    from overlap.engine.delivery import adapters
    from overlap.engine.delivery.sources import FetchError

    progress = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    if args.watch:
        adapters.watch(args.list, args.cache_dir, args.link_dir, interval_s=args.interval_s, progress=progress)
        return 0
    try:
        failed = adapters.sync(adapters.read_list(args.list), args.cache_dir, args.link_dir, progress=progress)
    except FetchError as exc:
        print(f"overlap model fetch-adapters: error: {exc}", file=sys.stderr)
        return 1
    return 1 if failed else 0


def _run_engine(args: argparse.Namespace) -> int:
    from overlap.engine.serving.server import run_engine_server

    return run_engine_server(
        socket_path=args.socket,
        config_path=args.config,
        model=args.model,
        overrides=engine_overrides(args),
        served_model_name=args.served_model_name,
    )
