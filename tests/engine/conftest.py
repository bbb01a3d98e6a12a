"""Engine tests import their helpers (fake runner, factories) from `tests.support.engine`; the
transformers reference for the tiny model is the `hf_greedy` fixture below, and `two_torch_threads` gives a module
the two intra-op threads the runner's CPU paths are tested with."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The GPU path's Triton kernels run on the CPU in Triton's interpreter, which is chosen when they are defined.
os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _no_process_group_left_open():
    """A test that leaves torch.distributed's default group open (a tensor-parallel runner not closed) fails here,
    by name, instead of every later test in the process that starts one (or that loads with compressed-tensors,
    which broadcasts when a group exists)."""
    yield
    import sys

    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
            pytest.fail("the test left a torch.distributed process group open: close its runner (runner.close())")


@pytest.fixture(scope="module")
def two_torch_threads():
    """torch on two intra-op threads for the module (the runner splits a batch in two halves with 2+), then back."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name of a tests/support/hf_models.py variant -> (its folder, transformers' model of it in fp32), each built
    once per module."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.support.hf_models import save_variant

    cache: dict[str, tuple[Path, object]] = {}

    def get(name: str):
        if name not in cache:
            folder = save_variant(name, tmp_path_factory.mktemp(name))
            cache[name] = (folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())
        return cache[name]

    return get


@pytest.fixture(scope="session")
def hf_greedy(tiny_model_dir: Path):
    """prompt, max_new_tokens -> transformers' greedy continuation (stops at EOS like the engine), memoised."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    cache: dict[tuple, list[int]] = {}

    def generate(prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in cache:
            with torch.inference_mode():
                out = model.generate(
                    torch.tensor([prompt]),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
            cache[key] = out[0, len(prompt) :].tolist()
        return cache[key]

    return generate
