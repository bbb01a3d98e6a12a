"""The model a benchmark runs, from its command line: `--model DIR`, or `--model-shape NAME`, a real family's shape
with random weights (`overlap model build-shape`), built into the cache on first use."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from overlap.engine.model.shapes import QUANT_SCHEMES, SHAPES


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--model", help="model folder (default: the tiny default model)")
    model.add_argument("--model-shape", choices=list(SHAPES), help="a real family's shape with random weights, built "
                       "once into the cache (overlap model build-shape)")  # fmt: skip
    parser.add_argument("--quantization", choices=list(QUANT_SCHEMES),
                        help="with --model-shape: the shape's projections in that scheme, as its producer writes it "
                        "(random codes; see `overlap model build-shape --help`)")  # fmt: skip


def model_folder(args: argparse.Namespace, progress: Callable[[str], None]) -> str | None:
    """The folder `--model` or `--model-shape` names (the shape built first if need be); None: neither was given."""
    if args.model_shape:
        from overlap.engine.model.shapes import ensure_shape_model

        return str(ensure_shape_model(args.model_shape, progress=progress, quantization=args.quantization))
    if getattr(args, "quantization", None):
        from overlap.engine.errors import ConfigError

        raise ConfigError("--quantization builds a quantized shape: it needs --model-shape")
    return args.model
