"""LoRA adapters made by PEFT on the tiny model: the base and four adapters mixed in one batch, each row's greedy
tokens equal to transformers + PEFT with that row's adapter; slots and host copies recycled; the prefix cache kept
apart per adapter; adapters that cannot apply refused with their reason."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch

from overlap.engine import Engine, EngineConfig, SamplingParams
from overlap.engine.errors import ConfigError, InvalidRequestError
from overlap.engine.model.lora import LoraError, read_adapter
from overlap.engine.model.model_spec import read_spec
from overlap.engine.model.native import lora_kernel
from overlap.engine.prefix_hash import block_hashes
from overlap.engine.types import RequestSpec
from tests.support.engine import run_to_completion, tokens_of
from tests.support.lora import make_adapter, peft_greedy

pytestmark = pytest.mark.usefixtures("two_torch_threads")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, rsLoRA, target modules): every module, some of them, ranks 2..16
ADAPTERS = {
    "all-r8": (8, 16, False, ALL),
    "qv-rs4": (4, 8, True, ["q_proj", "v_proj"]),
    "mlp-r16": (16, 8, False, ["o_proj", "gate_proj", "up_proj", "down_proj"]),
    "ku-r2": (2, 4, False, ["k_proj", "up_proj"]),
}
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(tiny_model_dir, root / name, *params, seed=i)
            for i, (name, params) in enumerate(ADAPTERS.items())}  # fmt: skip


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 8192) for _ in range(rng.randint(5, 40))] for _ in range(2)]


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path, adapters, prompts) -> dict[str | None, list[list[int]]]:
    """Each adapter's (None: the base's) greedy tokens per prompt, by transformers + PEFT."""
    runs = {None: peft_greedy(tiny_model_dir, None, prompts, NEW_TOKENS)}
    for name, folder in adapters.items():
        runs[name] = peft_greedy(tiny_model_dir, folder, prompts, NEW_TOKENS)
    return runs


def _engine(model_dir: Path, adapters: dict[str, Path], **config) -> Engine:
    config = {"max_seq_len": 128, "num_kv_blocks": 128, "enable_lora": True, "max_lora_rank": 16, **config}
    return Engine(EngineConfig(model=str(model_dir), lora_modules={k: str(v) for k, v in adapters.items()}, **config))


def _run_mixed(engine: Engine, prompts: list[list[int]], names: list[str | None]) -> dict[tuple, list[int]]:
    """Every prompt through every adapter (None: the base), all added before the first step."""
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for name in names:
        for i, prompt in enumerate(prompts):
            engine.add_request(RequestSpec(f"{name}/{i}", prompt, greedy, lora_name=name))
    outputs = run_to_completion(engine)
    return {(name, i): tokens_of(outputs[f"{name}/{i}"]) for name in names for i in range(len(prompts))}


def test_mixed_batch_matches_peft(tiny_model_dir: Path, adapters, prompts, expected) -> None:
    """The base and four adapters in the same steps (a slot each): every row computed with its own adapter."""
    names = [None, *adapters]
    for name in adapters:  # the adapters change the tokens, so a row served by the wrong one would show
        assert expected[name] != expected[None], name
    engine = _engine(tiny_model_dir, adapters, max_loras=4)
    assert (engine.runner.model.lora.native is None) == (lora_kernel() is None)  # one native call where it builds
    got = _run_mixed(engine, prompts, names)
    assert engine.stats()["last_batch_size"] == len(names) * len(prompts)  # one batch held them all
    for name in names:
        for i in range(len(prompts)):
            assert got[name, i] == expected[name][i][:NEW_TOKENS], (name, i)


@pytest.fixture(scope="module")
def qwen2_case(built, tmp_path_factory) -> tuple[Path, dict[str, Path], list[list[int]], dict]:
    """A Qwen2 shape, the four adapters of ADAPTERS made on it by PEFT, two prompts, and PEFT's tokens for each."""
    folder = built("qwen2")[0]
    root = tmp_path_factory.mktemp("qwen2-adapters")
    adapters = {name: make_adapter(folder, root / name, *params, seed=11 + i, spread=0.3)
                for i, (name, params) in enumerate(ADAPTERS.items())}  # fmt: skip
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (9, 30)]
    expected = {name: peft_greedy(folder, adapters.get(name), prompts, NEW_TOKENS) for name in (None, *adapters)}
    for name in adapters:  # each adapter changes the tokens, so a row served by the wrong one would show
        assert expected[name] != expected[None], name
    return folder, adapters, prompts, expected


@pytest.mark.parametrize("size", [1, 2])
def test_qwen2_shape_mixed_on_one_and_two_ranks(qwen2_case, size: int) -> None:
    """A Qwen2 shape (GQA, q/k/v biases, tied embeddings) with four adapters and the base in one batch, on one rank
    and split across two (each rank holds B's rows of q|k|v and gate|up, A's columns of o and down): PEFT's tokens."""
    folder, adapters, prompts, expected = qwen2_case
    engine = _engine(folder, adapters, max_loras=4, tensor_parallel_size=size, num_threads=1)
    try:
        got = _run_mixed(engine, prompts, [None, *adapters])
    finally:
        engine.close()
        engine.runner.close()  # its process group: left open, every later tensor-parallel test in this process fails
    for (name, i), tokens in got.items():
        assert tokens == expected[name][i][:NEW_TOKENS], (name, i)


def test_slots_and_host_copies_recycled(tiny_model_dir: Path, adapters, prompts, expected) -> None:
    """Two device slots and two host copies for four adapters: requests wait for a slot, adapters are read again
    from their folders, and every request still gets its own adapter's tokens."""
    engine = _engine(tiny_model_dir, adapters, max_loras=2, max_cpu_loras=2)
    names = [*adapters, None, *reversed(adapters)]
    got = _run_mixed(engine, prompts[:1], list(dict.fromkeys(names)))
    for (name, i), tokens in got.items():
        assert tokens == expected[name][i][:NEW_TOKENS], name
    # unloaded: new requests are refused, the base still serves
    assert engine.loras.remove("all-r8")
    with pytest.raises(InvalidRequestError, match="no LoRA adapter 'all-r8'"):
        engine.add_request(RequestSpec("late", prompts[0], SamplingParams(max_tokens=2), lora_name="all-r8"))


def test_unload_lets_running_requests_finish(tiny_model_dir: Path, adapters, prompts, expected) -> None:
    engine = _engine(tiny_model_dir, {"qv-rs4": adapters["qv-rs4"]})
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    engine.add_request(RequestSpec("r", prompts[0], greedy, lora_name="qv-rs4"))
    first = engine.step()
    assert engine.loras.remove("qv-rs4") and engine.loras.snapshot() == {}
    outputs = first + [out for outs in run_to_completion(engine).values() for out in outs]
    assert tokens_of(outputs) == expected["qv-rs4"][0][:NEW_TOKENS]


def test_prefix_cache_is_kept_apart_per_adapter(tiny_model_dir: Path, adapters, expected) -> None:
    """The same prompt through the base, then an adapter, then the adapter again: only the second adapter request
    reuses KV (the adapter's own), and its tokens stay PEFT's. The same name loaded again from another folder is
    another adapter: none of the first one's KV."""
    prompt = [5 + i for i in range(40)]
    engine = _engine(tiny_model_dir, {"all-r8": adapters["all-r8"]})
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    cached = {}
    for rid, name in (("base", None), ("lora", "all-r8"), ("again", "all-r8"), ("reloaded", "all-r8")):
        if rid == "reloaded":
            assert engine.loras.remove("all-r8")
            engine.loras.add("all-r8", str(adapters["qv-rs4"]))
        engine.add_request(RequestSpec(rid, prompt, greedy, lora_name=name))
        outputs = run_to_completion(engine)[rid]
        cached[rid] = outputs[-1].num_cached_tokens
        if name is not None:
            folder = adapters["qv-rs4" if rid == "reloaded" else name]
            assert tokens_of(outputs) == peft_greedy(tiny_model_dir, folder, [prompt], 4)[0]
    assert cached == {"base": 0, "lora": 0, "again": 32, "reloaded": 0}
    one, other = ("all-r8", str(adapters["all-r8"])), ("all-r8", str(adapters["qv-rs4"]))
    assert block_hashes(prompt, 16) != block_hashes(prompt, 16, one) != block_hashes(prompt, 16, other)


def test_bad_adapters_are_refused(tiny_model_dir: Path, adapters, built, tmp_path: Path) -> None:
    spec = read_spec(tiny_model_dir)
    with pytest.raises(LoraError, match="rank 16, above max_lora_rank 8"):
        read_adapter("big", adapters["mlp-r16"], spec, max_rank=8)
    other = make_adapter(built("qwen2")[0], tmp_path / "other", 4, 8, False, ["q_proj"], seed=9)
    with pytest.raises(LoraError, match=r"made for another base model: layers\.0\.q_proj"):
        read_adapter("other", other, spec, max_rank=16)
    head = make_adapter(tiny_model_dir, tmp_path / "head", 4, 8, False, ["q_proj", "lm_head"], seed=9)
    with pytest.raises(LoraError, match="unknown target modules lm_head"):
        read_adapter("head", head, spec, max_rank=16)
    with pytest.raises(LoraError, match=r"no adapter_config\.json"):
        read_adapter("none", tmp_path, spec, max_rank=16)
    _malformed_folders_are_refused(adapters["qv-rs4"], spec, tmp_path)
    engine = _engine(tiny_model_dir, {}, max_lora_rank=8)
    with pytest.raises(LoraError, match="above max_lora_rank"):
        engine.loras.add("big", str(adapters["mlp-r16"]))
    assert engine.loras.snapshot() == {}
    with pytest.raises(ConfigError, match="need enable_lora"):
        Engine(EngineConfig(model=str(tiny_model_dir), max_seq_len=64, num_kv_blocks=16)).loras.add("a", "b")


def _malformed_folders_are_refused(good: Path, spec, tmp_path: Path) -> None:
    """Folders no PEFT writes, or half-delivered ones: a LoraError with the reason, never another exception."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    def folder_with(name, config=None, weights=None):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        if config is not None:
            (folder / "adapter_config.json").write_text(json.dumps(config))
        if weights is not None:
            (folder / "adapter_model.safetensors").unlink()
            if isinstance(weights, str):
                (folder / "adapter_model.safetensors").write_text(weights)
            else:
                save_file(weights, str(folder / "adapter_model.safetensors"))
        return folder

    config = json.loads((good / "adapter_config.json").read_text())
    tensors = load_file(str(good / "adapter_model.safetensors"))
    cases = [
        (folder_with("list", config=["q_proj"]), "adapter_config.json must hold an object, got list"),
        (folder_with("targets", config={**config, "target_modules": 5}), "target_modules must be a list"),
        (folder_with("lfs", weights="version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9\n"),
         "cannot read adapter_model.safetensors"),
        (folder_with("vision", weights={k.replace("model.model.layers", "model.vision_model.encoder.layers"): t
                                        for k, t in tensors.items()}), "is not a LoRA weight of a known module"),
        (folder_with("twice", weights={**tensors, **{k.replace("base_model.model.", ""): t.clone()
                                                     for k, t in tensors.items()}}), "two tensors are lora_"),
    ]  # fmt: skip
    for folder, message in cases:
        with pytest.raises(LoraError, match=message):
            read_adapter(folder.name, folder, spec, max_rank=16)
    # PEFT's other form of target_modules, a regular expression over module names: the tensors say which
    regex = folder_with("regex", config={**config, "target_modules": r".*\.(q_proj|v_proj)"})
    assert read_adapter("regex", regex, spec, max_rank=16).modules.keys() == \
        read_adapter("list", good, spec, max_rank=16).modules.keys()  # fmt: skip


def _run_and_close(engine: Engine, prompt: list[int], names: list[str | None]) -> dict[str, list]:
    """`prompt` through each adapter (None: the base), all added before the first step, under the id str(name); the
    outputs by id once all finished. The engine and its runner are closed after."""
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    for name in names:
        engine.add_request(RequestSpec(f"{name}", prompt, greedy, lora_name=name))
    try:
        return run_to_completion(engine)
    finally:
        engine.close()
        engine.runner.close()


def test_an_adapter_folder_gone_since_its_load_fails_only_its_requests(
    tiny_model_dir: Path, adapters, prompts, expected, tmp_path: Path, monkeypatch
) -> None:
    """One host copy for two adapters: the first's folder is deleted after both were loaded, so its copy, pushed out
    of host memory by the second's, cannot be read again. Its request finishes with ERROR saying why; the base's and
    the second adapter's requests, in the same steps, get their own tokens. Every read after the load runs on the
    reader thread, none on the thread that steps the engine."""
    import shutil
    import threading

    from overlap.engine.model import lora

    gone, kept = tmp_path / "gone", tmp_path / "kept"
    shutil.copytree(adapters["qv-rs4"], gone)
    shutil.copytree(adapters["ku-r2"], kept)
    # the second's folder as a user may write it (a trailing slash): its host copy still answers for it
    engine = _engine(tiny_model_dir, {"qv-rs4": gone, "ku-r2": f"{kept}/"}, max_loras=1, max_cpu_loras=1)
    shutil.rmtree(gone)
    readers, read = [], lora.read_adapter
    monkeypatch.setattr(lora, "read_adapter", lambda *a, **k: readers.append(threading.current_thread().name)
                        or read(*a, **k))  # fmt: skip
    outputs = _run_and_close(engine, prompts[0], [None, "qv-rs4", "ku-r2"])
    failed = outputs["qv-rs4"][-1]
    assert failed.finish_reason.value == "error" and "LoRA adapter 'qv-rs4' cannot be read" in failed.error
    assert tokens_of(outputs["None"]) == expected[None][0][:NEW_TOKENS]
    assert tokens_of(outputs["ku-r2"]) == expected["ku-r2"][0][:NEW_TOKENS]
    assert readers and all(name.startswith("overlap-lora-read") for name in readers), readers


def test_a_staged_adapter_is_kept_for_its_slot_though_host_memory_lets_it_go(
    tiny_model_dir: Path, adapters, prompts, expected, tmp_path: Path
) -> None:
    """Staged (read for the request at the queue's head), then pushed out of host memory by another adapter's load
    before its slot is filled, and its folder deleted: the slot is filled from the staged copy, and its request and
    the base's get their own tokens."""
    import shutil

    first = tmp_path / "first"
    shutil.copytree(adapters["mlp-r16"], first)
    engine = _engine(tiny_model_dir, {}, max_loras=1, max_cpu_loras=1)
    engine.loras.add("mlp-r16", str(first))
    cache = engine.runner.lora
    cache.host.clear()  # as if evicted since its load
    deadline = time.monotonic() + 30
    while (staged := cache.stage("mlp-r16", str(first))) is not True:
        assert staged is False and time.monotonic() < deadline, staged
        time.sleep(0.01)
    engine.loras.add("ku-r2", str(adapters["ku-r2"]))  # a load: read into host memory, "mlp-r16" out
    assert list(cache.host) == ["ku-r2"]
    shutil.rmtree(first)
    outputs = _run_and_close(engine, prompts[0], ["mlp-r16", None])
    assert tokens_of(outputs["mlp-r16"]) == expected["mlp-r16"][0][:NEW_TOKENS]
    assert tokens_of(outputs["None"]) == expected[None][0][:NEW_TOKENS]


def test_the_other_ranks_fill_a_slot_from_rank_0s_copy(qwen2_case, tmp_path: Path) -> None:
    """Split across two ranks, an adapter whose folder is deleted after its load: rank 0 read it at the load and
    hands its copy to rank 1 before the step that fills the slot, so no rank reads the folder in a step (rank 1 used
    to, and died on the missing folder). Its request and the base's get PEFT's tokens."""
    import shutil

    folder, adapters, prompts, expected = qwen2_case
    copy = tmp_path / "mlp-r16"
    shutil.copytree(adapters["mlp-r16"], copy)
    engine = _engine(folder, {"mlp-r16": copy}, max_loras=1, max_cpu_loras=1, tensor_parallel_size=2,
                     num_threads=1)  # fmt: skip
    shutil.rmtree(copy)
    outputs = _run_and_close(engine, prompts[0], ["mlp-r16", None])
    assert tokens_of(outputs["mlp-r16"]) == expected["mlp-r16"][0][:NEW_TOKENS]
    assert tokens_of(outputs["None"]) == expected[None][0][:NEW_TOKENS]


def test_shared_memory_full_fails_the_staging_with_the_reason(tiny_model_dir: Path, adapters, monkeypatch) -> None:
    """Rank 0 under tensor parallelism stages into shared memory, on the reader thread: where that is full, the
    staging answers the reason (which fails the adapter's waiting requests), not an exception in the scheduler."""
    from overlap.engine.model import lora

    engine = _engine(tiny_model_dir, {"ku-r2": adapters["ku-r2"]}, max_loras=1)
    cache = engine.runner.lora
    cache.share = True  # as rank 0's cache is with other ranks
    threads = []

    def full(adapter):
        threads.append(threading.current_thread().name)
        raise RuntimeError("unable to allocate shared memory(shm) for file </torch_1>: No space left on device")

    monkeypatch.setattr(lora.LoraAdapter, "shared", full)
    deadline = time.monotonic() + 30
    try:
        while (staged := cache.stage("ku-r2", str(adapters["ku-r2"]))) is False:  # its host copy, shared there
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        engine.close()
        engine.runner.close()
    assert isinstance(staged, str) and "No space left on device" in staged, staged
    assert threads and all(name.startswith("overlap-lora-read") for name in threads), threads


def test_a_slot_fill_that_failed_is_filled_again() -> None:
    """A step that was to fill a slot failed (the adapter's folder unreadable): the next request through that adapter
    fills the slot again instead of running on whatever the slot held."""
    from types import SimpleNamespace

    from overlap.engine.batching.lora_slots import LoraSlots

    slots = LoraSlots(1)
    first = SimpleNamespace(lora_name="a", lora_path="/a", lora_slot=-1)
    slots.acquire(first)
    loads = slots.take_loads()
    assert loads == [(0, "a", "/a")]
    slots.release(first)  # its step failed: the request finished with ERROR
    slots.forget(loads)
    again = SimpleNamespace(lora_name="a", lora_path="/a", lora_slot=-1)
    assert slots.can_acquire(again)
    slots.acquire(again)
    assert slots.take_loads() == [(0, "a", "/a")] and slots.holds == [("a", "/a")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_bgmv_matches_the_gathered_matmuls(dtype) -> None:
    """The GPU path's kernels (Triton's interpreter on CPU) against the CPU path's gathered matmuls and a row-by-row
    reference: rows of three adapters and the base in any order, ragged sizes (3 segments of rank 4, 96 inputs, 80
    outputs), base rows untouched."""
    pytest.importorskip("triton")
    from overlap.engine.model import triton_lora
    from overlap.engine.model.lora import LoraBatch, LoraDelta, RowSlots

    gen = torch.Generator().manual_seed(0)
    batch = LoraBatch(None)
    delta = LoraDelta(batch, 3, 4, 3, 96, (0, 80), dtype, torch.device("cpu"))
    delta.a.copy_(torch.randn(delta.a.shape, generator=gen))
    delta.b.copy_(torch.randn(delta.b.shape, generator=gen) * 0.1)
    slots = [-1, 0, 2, 2, 1, -1, 0]
    x = torch.randn(7, 96, generator=gen).to(dtype)
    base = torch.randn(7, 80, generator=gen).to(dtype)
    batch.current = RowSlots(slots, torch.device("cpu"))
    gathered = delta.apply(x, base.clone())
    kernel = triton_lora.lora_bgmv(x, base.clone(), delta.a, delta.b, torch.tensor(slots, dtype=torch.int32))
    rows = [base[t].float() + (delta.b[s].float() @ (delta.a[s].float() @ x[t].float()) if s >= 0 else 0)
            for t, s in enumerate(slots)]  # fmt: skip
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 2e-2}
    torch.testing.assert_close(kernel.float(), torch.stack(rows), **tolerance)
    torch.testing.assert_close(gathered.float(), torch.stack(rows), **tolerance)
    assert torch.equal(kernel[0], base[0]) and torch.equal(kernel[5], base[5])


@pytest.mark.parametrize("march", [None, "x86-64-v3"], ids=["native", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_native_delta_matches_the_torch_formula(dtype, march) -> None:
    """The CPU path's one native call per projection against a row-by-row reference and the gathered matmuls: rows of
    three adapters and the base in any order (strided x), ranks not a multiple of the kernel's 4 (3 segments of
    rank 3), outputs past a column tile and not a whole number of vectors, base rows untouched; B dense on one slot,
    block-diagonal with a rank of 2 on another (the kernel skips the zero ranks), zero on a third; then the sampled
    subset of those rows; then more rows than the kernel takes (the gathered matmuls). Built for this CPU, and for
    AVX2 alone (x86-64-v3: the other width of its vectors), which this CPU runs too."""
    from overlap.engine.model.lora import LoraBatch, LoraDelta, RowSlots

    if lora_kernel() is None:
        pytest.skip("no C compiler: the CPU path uses the gathered matmuls")
    kernel = lora_kernel(march)
    gen, cpu = torch.Generator().manual_seed(0), torch.device("cpu")
    native, gathered = LoraBatch(None, kernel), LoraBatch(None)
    delta = LoraDelta(native, 4, 3, 3, 96, (0, 300), dtype, cpu, segment_starts=(0, 100, 232))
    delta.a.copy_(torch.randn(delta.a.shape, generator=gen))
    delta.b.copy_(torch.randn(delta.b.shape, generator=gen) * 0.1)
    for segment, (first, last) in enumerate([(0, 100), (100, 232), (232, 300)]):  # slot 2: its own ranks, 2 of 3
        delta.b[2, :first, segment * 3 : segment * 3 + 3] = 0
        delta.b[2, last:, segment * 3 : segment * 3 + 3] = 0
        delta.b[2, :, segment * 3 + 2] = 0
    delta.b[0, :, :] = 0
    for slot in range(4):
        delta.refresh(slot)
    assert delta.spans[2].tolist() == [[0, 2], [3, 5], [6, 8]] and delta.spans[0].tolist() == [[0, 0]] * 3
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 2e-2}
    slots = [-1, 3, 0, 2, 2, 0, -1, 3, 0, 2, 2, 2, 2, 3, 3]
    x = torch.randn(len(slots), 120, generator=gen).to(dtype)[:, 10:106]
    base = torch.randn(len(slots), 300, generator=gen).to(dtype)
    many = [3] * (kernel.ROWS_ONE_ADAPTER + 5)  # one adapter's rows past the kernel's: the gathered matmuls
    many_mixed = [slots[i % len(slots)] for i in range(kernel.ROWS_ONE_ADAPTER * 3)]  # several adapters: the kernel
    # every row, the sampled ones, a prefill of one adapter, one of several
    cases = (range(len(slots)), [1, 4, 6, 8, 9, 10, 11], range(len(many)), range(len(many_mixed)))
    for rows, row_slots in zip(cases, (slots, slots, many, many_mixed), strict=True):
        picked = [row_slots[r] for r in rows]
        xs = x[[r % len(slots) for r in rows]]
        ys = base[[r % len(slots) for r in rows]]
        expected = torch.stack([ys[t].float() + (delta.b[s].float() @ (delta.a[s].float() @ xs[t].float()) if s >= 0
                                                 else 0) for t, s in enumerate(picked)])  # fmt: skip
        results = []
        for batch in (native, gathered):
            delta.batch, batch.current = batch, RowSlots(picked, cpu)
            results.append(delta.apply(xs, ys.clone()))
        for got in results:
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), expected, **tolerance)
        for t, s in enumerate(picked):
            if s < 0:
                assert torch.equal(results[0][t], ys[t])


def test_adapters_over_a_quantized_base(tiny_model_dir: Path, adapters, prompts, tmp_path: Path) -> None:
    """The tiny model as a GPTQ W4 checkpoint (its projections through the CPU's int kernels): two adapters and the
    base in one batch equal transformers + PEFT on the float weights the codes stand for."""
    import shutil

    from safetensors.torch import save_file

    from tests.support import handwritten_checkpoints

    quantized = tmp_path / "gptq"
    reference = handwritten_checkpoints.write(tiny_model_dir, quantized, method="gptq", group=32)
    dequantized = Path(shutil.copytree(tiny_model_dir, tmp_path / "dequantized"))
    save_file({name: tensor.contiguous() for name, tensor in reference.items()}, str(dequantized / "model.safetensors"))
    names = [None, "all-r8", "qv-rs4"]
    expected = {name: peft_greedy(dequantized, adapters.get(name), prompts, NEW_TOKENS) for name in names}
    engine = _engine(quantized, {name: adapters[name] for name in names[1:]}, max_loras=2)
    assert engine.quantization.startswith("gptq W4A16")
    layer = engine.runner.model.layers[0]
    assert layer.qkv.quant is not None and layer.qkv.lora is not None  # the int kernel, the delta beside it
    for (name, i), tokens in _run_mixed(engine, prompts, names).items():
        assert tokens == expected[name][i][:NEW_TOKENS], (name, i)
