"""gpt-oss's MXFP4 checkpoints, written here from a float gpt-oss folder the way the released ones lay them out
(openai/gpt-oss-20b, quant_method mxfp4): each layer's fused experts as `mlp.experts.gate_up_proj_blocks` /
`_scales` and `down_proj_blocks` / `_scales`, output-major (the float parameters transposed), the rest as it was.

The format (the OCP microscaling spec's MXFP4, as transformers' integrations/mxfp4.py reads it): each run of 32
values along a row's inputs shares one power of two, stored as a uint8 exponent biased by 127 (`*_scales`
[E, out, in / 32]); each value is an e2m1 code (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6),
two a byte, value 2j in the low nibble and 2j + 1 in the high one (`*_blocks` [E, out, in / 32, 16]).

The scale of a block is the smallest power of two that brings its largest magnitude within 6, each value then rounded
to the nearest code (ties to the even code): a producer's choice, which any reader of the format reads alike.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
BLOCK = 32


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [..., in] (in a multiple of 32) -> (blocks uint8 [..., in / 32, 16], scales uint8 [..., in / 32], the
    float values they stand for [..., in], computed here without going through the packing)."""
    w = weight.double().unflatten(-1, (-1, BLOCK))  # [..., G, 32]
    top = w.abs().amax(-1)
    exponent = torch.where(top > 0, torch.ceil(torch.log2(top / 6.0)), torch.zeros_like(top)).clamp(-127, 127)
    scaled = w / torch.exp2(exponent).unsqueeze(-1)  # within [-6, 6]
    # the nearest e2m1 magnitude; on a tie the even code (the lower of the two here, whose mantissa bit is 0)
    distance = (scaled.abs().unsqueeze(-1) - E2M1.double()).abs()
    magnitude = torch.argmin(distance + torch.arange(8, dtype=torch.float64) * 1e-12, dim=-1)
    codes = (magnitude | ((scaled < 0) & (magnitude > 0)).long() * 8).to(torch.uint8)  # no negative zero
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    values = E2M1.double()[magnitude] * torch.where(scaled < 0, -1.0, 1.0) * torch.exp2(exponent).unsqueeze(-1)
    return blocks.to(torch.uint8), (exponent + 127).to(torch.uint8), values.flatten(-2).float()


def mxfp4_folder(float_folder: Path, folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A copy of the float gpt-oss folder with its experts' gate|up and down in MXFP4, and the float tensors
    (transformers' parameter layout, [E, in, out]) the MXFP4 ones stand for, by parameter name."""
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(float_folder, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    expected = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # the parameters are [E, in, out]; the checkpoint's blocks run along the inputs of each output row
        blocks, scales, values = quantize(tensors.pop(name).transpose(1, 2).contiguous())
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        expected[name] = values.transpose(1, 2).contiguous()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder, expected
