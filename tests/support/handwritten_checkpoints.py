"""GPTQ, AWQ and block-FP8 checkpoints written by hand, for the loader's tests: a float model's projections quantized
to 4-bit codes (round to nearest, min-max per group; no calibration: the tests check the layout, not the quantizer),
packed as AutoGPTQ / GPTQModel and AutoAWQ pack them, or to FP8 with a scale per 128x128 block as the DeepSeek-V3 and
Qwen3 FP8 releases ship them (`quant_method: fp8`, `weight_scale_inv`; the GPU tools that write those do not run on a
CPU), and saved with their `quantization_config`.

Each writer returns, beside the folder, the weights its codes stand for (`dequantized`), so transformers can run the
same model in float as the reference. The packing is written from the formats' own unpacking rules (GPTQ: 8 codes a
word along the inputs, zero points minus one in checkpoint_format "gptq"; AWQ: 8 codes a word along the outputs in
the order 0 2 4 6 1 3 5 7) and is checked against the formats' reference dequantizers in
tests/engine/test_quantized.py; transformers itself loads the block-FP8 folders (dequantized on a CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# w1, w3, w2: Mixtral's experts' gate, up and down
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def quantize(weight: torch.Tensor, group: int, symmetric: bool, g_idx: torch.Tensor | None = None):
    """Codes [N, K] in 0..15, scales and zero points [N, K/G] of `weight` [N, K] (round to nearest); with `g_idx`,
    column k belongs to group g_idx[k] (act-order)."""
    n, k = weight.shape
    g_idx = torch.arange(k) // group if g_idx is None else g_idx
    groups = k // group
    w = weight.float()
    scale, zero = torch.empty(n, groups), torch.empty(n, groups)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if symmetric:
            scale[:, g] = cols.abs().amax(1).clamp_min(1e-8) / 7.5
            zero[:, g] = 8
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scale[:, g] = ((hi - lo) / 15).clamp_min(1e-8)
            zero[:, g] = torch.round(-lo / scale[:, g]).clamp(0, 15)
    scale = scale.to(torch.float16).float()  # as stored: the codes are chosen against the stored scales
    s, z = scale[:, g_idx], zero[:, g_idx]
    codes = torch.clamp(torch.round(w / s) + z, 0, 15).to(torch.int32)
    return codes, scale, zero.to(torch.int32), g_idx


def dequantize(codes, scale, zero, g_idx) -> torch.Tensor:
    return (codes.float() - zero[:, g_idx].float()) * scale[:, g_idx]


def pack_along_last(codes: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """8 four-bit codes a little-endian int32 word, along the last dim; nibble i holds the code at offset order[i]."""
    rows, cols = codes.shape
    grouped = codes.view(rows, cols // 8, 8)[:, :, list(order)].to(torch.int64)
    words = sum(grouped[:, :, i] << (4 * i) for i in range(8))
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement: the top nibble may set bit 31


def gptq_tensors(weight: torch.Tensor, group: int, desc_act: bool, symmetric: bool, v1: bool = True, seed: int = 0):
    """(tensors by suffix, dequantized weight) in GPTQ's layout; desc_act: a random act-order (g_idx)."""
    k = weight.shape[1]
    g_idx = None
    if desc_act:
        order = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[order] = torch.arange(k) // group  # the columns in quantization order fill groups in turn
    codes, scale, zero, g_idx = quantize(weight, group, symmetric, g_idx)
    tensors = {
        "qweight": pack_along_last(codes).t().contiguous(),  # 8 codes a word along K: [K/8, N]
        "qzeros": pack_along_last((zero - (1 if v1 else 0)).t().contiguous()),  # [K/G, N/8]
        "scales": scale.t().contiguous().to(torch.float16),  # [K/G, N]
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, dequantize(codes, scale, zero, g_idx)


def awq_tensors(weight: torch.Tensor, group: int):
    """(tensors by suffix, dequantized weight) in AutoAWQ's GEMM layout."""
    codes, scale, zero, g_idx = quantize(weight, group, symmetric=False)
    tensors = {
        "qweight": pack_along_last(codes.t().contiguous(), AWQ_ORDER),  # [K, N/8]
        "qzeros": pack_along_last(zero.t().contiguous(), AWQ_ORDER),  # [K/G, N/8]
        "scales": scale.t().contiguous().to(torch.float16),  # [K/G, N]
    }
    return tensors, dequantize(codes, scale, zero, g_idx)


def block_fp8_tensors(weight: torch.Tensor, block: int):
    """(tensors by suffix, dequantized weight): float8_e4m3fn weights, each block x block tile scaled to its absmax
    (scale = absmax / 448, stored as `weight_scale_inv`, the factor that dequantizes)."""
    n, k = weight.shape
    tiles = weight.float().view(n // block, block, k // block, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / 448).clamp_min(1e-12)
    fp8 = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    dequantized = (fp8.float() * scale[:, None, :, None]).view(n, k)
    return {"weight": fp8.view(n, k), "weight_scale_inv": scale}, dequantized


def write(dense_folder: Path, out: Path, method: str, group: int = 128, desc_act: bool = False,
          symmetric: bool = True) -> dict[str, torch.Tensor]:  # fmt: skip
    """`dense_folder` (a float HF checkpoint, one safetensors file) as a GPTQ, AWQ or block-FP8 (`method` "fp8",
    `group` the block) checkpoint in `out`; returns the float state dict its codes stand for (the reference model's
    weights)."""
    out.mkdir(parents=True, exist_ok=True)
    state = load_file(str(dense_folder / "model.safetensors"))
    saved, reference = {}, {}
    for name, tensor in state.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.rsplit(".", 1)[-1] not in PROJECTIONS:
            saved[name] = tensor
            reference[name] = tensor.float()
            continue
        if method == "gptq":
            packed, deq = gptq_tensors(tensor, group, desc_act, symmetric, seed=len(saved))
        elif method == "fp8":
            packed, deq = block_fp8_tensors(tensor, group)
        else:
            packed, deq = awq_tensors(tensor, group)
        saved.update({f"{module}.{suffix}": t for suffix, t in packed.items()})
        reference[name] = deq
    save_file(saved, str(out / "model.safetensors"))
    config = json.loads((dense_folder / "config.json").read_text())
    if method == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
                                         "sym": symmetric, "checkpoint_format": "gptq"}  # fmt: skip
    elif method == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [group, group]}  # fmt: skip
    else:
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                         "version": "gemm"}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in dense_folder.iterdir():
        if extra.name not in ("config.json", "model.safetensors") and extra.is_file():
            (out / extra.name).write_bytes(extra.read_bytes())
    return reference
