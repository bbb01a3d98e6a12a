"""The routed experts of a sparse layer as two Triton kernels (a grouped GEMM over tokens sorted by expert), on the
device paths (CUDA); layers/moe.py calls it after routing.

A step has T tokens and k experts a token: T * k (token, expert) pairs. They are sorted by expert and each expert's
run is padded to a multiple of BLOCK_M rows (`align`), so that every block of BLOCK_M rows belongs to one expert.
The first kernel computes a block's SiLU(gate) * up from that expert's gate|up rows (gpt-oss: its biases added and
its clamped SwiGLU, layers/mlp.py); the second its down projection (plus its bias), scaled by each pair's routing
weight, into the pair's row. Each program reads one tile of one expert's weights: a
step reads each active expert's weights once per block of its tokens, and an inactive expert's never. The token sum
over the k pairs is one torch sum, in the order transformers sums them.

Everything is sized from the step's shape alone (at most cdiv(T k, BLOCK_M) + min(E, T k) blocks; blocks past the
last expert's run have expert -1 and exit): no host sync, so decode steps can be captured in CUDA graphs.

Tests run it on the CPU in Triton's interpreter against the torch path (tests/engine/test_moe.py) and, through the
conformance matrix's `triton` path, against transformers.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's interpreter computes a bf16 tl.dot wrongly (see quant/triton_kernels.py): there the dots take fp32
# operands, the same numbers widened.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, bias_ptr, pairs_ptr, block_expert_ptr, act_ptr, num_pairs, hidden, inter,
                    x_stride, alpha, limit, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr, BIAS: tl.constexpr,
                    SWIGLU: tl.constexpr):  # fmt: skip
    """act[row, n] = silu(x[token] . gate[e, n]) * (x[token] . up[e, n]) for the rows of block program_id(0), whose
    pairs all go to expert e; gate and up rounded to the model dtype first, as torch's matmul output is. BIAS adds
    the expert's gate and up biases (rounded again, as transformers adds them after the matmul); SWIGLU is gpt-oss's
    clamped SwiGLU, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g) with g = min(gate, limit), rounded op by
    op."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= 0:
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + rows)
        valid = pair < num_pairs
        token = (pair // TOP_K).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter
        w = w_ptr + expert.to(tl.int64) * (2 * inter * hidden)
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < hidden
            a = tl.load(x_ptr + token[:, None] * x_stride + kk[None, :], mask=valid[:, None] & k_ok[None, :],
                        other=0.0)  # fmt: skip
            w_mask = k_ok[:, None] & col_ok[None, :]
            wg = tl.load(w + cols[None, :] * hidden + kk[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
            wu = tl.load(w + (inter + cols[None, :]) * hidden + kk[:, None], mask=w_mask, other=0.0)
            if DOT_FP32:
                gate += tl.dot(a.to(tl.float32), wg.to(tl.float32), input_precision="ieee")
                up += tl.dot(a.to(tl.float32), wu.to(tl.float32), input_precision="ieee")
            else:
                gate += tl.dot(a, wg)
                up += tl.dot(a, wu)
        dtype = act_ptr.dtype.element_ty
        gate = gate.to(dtype).to(tl.float32)
        up = up.to(dtype).to(tl.float32)
        if BIAS:
            b = bias_ptr + expert.to(tl.int64) * (2 * inter)
            gate = (gate + tl.load(b + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
            up = (up + tl.load(b + inter + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]).to(dtype)
            up = up.to(tl.float32)
        if SWIGLU:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            sig = tl.sigmoid((gate * alpha).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            glu = (gate * sig).to(dtype).to(tl.float32)
            act = (up + 1.0).to(dtype).to(tl.float32) * glu
        else:
            silu = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
            act = silu * up
        tl.store(act_ptr + rows[:, None].to(tl.int64) * inter + cols[None, :], act.to(dtype),
                 mask=valid[:, None] & col_ok[None, :])  # fmt: skip


@triton.jit
def _down_kernel(act_ptr, w_ptr, bias_ptr, pairs_ptr, block_expert_ptr, weight_ptr, out_ptr, num_pairs, hidden,
                 inter, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
                 BIAS: tl.constexpr):  # fmt: skip
    """out[pair, n] = (act[row] . down[e, n] (+ bias[e, n])) * weight[pair], the product (and the sum with the bias)
    rounded to the model dtype first."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= 0:
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + rows)
        valid = pair < num_pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        w = w_ptr + expert.to(tl.int64) * (hidden * inter)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < inter
            a = tl.load(act_ptr + rows[:, None].to(tl.int64) * inter + kk[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            wd = tl.load(w + cols[None, :] * inter + kk[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if DOT_FP32:
                acc += tl.dot(a.to(tl.float32), wd.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, wd)
        scale = tl.load(weight_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        y = acc.to(act_ptr.dtype.element_ty).to(tl.float32)
        if BIAS:
            bias = tl.load(bias_ptr + expert.to(tl.int64) * hidden + cols, mask=col_ok, other=0.0).to(tl.float32)
            y = (y + bias[None, :]).to(act_ptr.dtype.element_ty).to(tl.float32)
        y = y * scale[:, None]
        tl.store(out_ptr + pair[:, None].to(tl.int64) * hidden + cols[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=valid[:, None] & col_ok[None, :])  # fmt: skip


def align(ids: torch.Tensor, num_experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs of `ids` [T, k] (pair p = token * k + slot) sorted by expert, each expert's run
    padded to a multiple of `block` with the pair count (an invalid pair), and each block's expert (-1 past the
    last run); int32, sized from the shape alone."""
    flat = ids.reshape(-1)
    n, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    padded_end = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat.index_select(0, order)
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts).index_select(0, expert_of)
    position = (padded_end - padded).index_select(0, expert_of) + rank
    blocks = triton.cdiv(n, block) + min(num_experts, n)
    pairs = torch.full((blocks * block,), n, dtype=torch.int64, device=device).index_copy_(0, position, order)
    starts = torch.arange(blocks, device=device) * block
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return pairs.to(torch.int32), block_expert.to(torch.int32)


class FusedMoE:
    """One sparse layer's routed experts: gate|up [E, 2 I, H] and down [E, H, I], used in place; optionally their
    biases [E, 2 I] and [E, H] and gpt-oss's clamped SwiGLU, `swiglu` = (alpha, limit)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                 down_bias: torch.Tensor | None = None, swiglu: tuple[float, float] | None = None) -> None:  # fmt: skip
        self.gate_up, self.down = gate_up.contiguous(), down.contiguous()
        self.gate_up_bias = None if gate_up_bias is None else gate_up_bias.contiguous()
        self.down_bias = None if down_bias is None else down_bias.contiguous()
        self.swiglu = swiglu
        self.num_experts, self.inter, self.hidden = down.shape[0], down.shape[2], down.shape[1]

    def blocks(self, pairs: int, dtype: torch.dtype) -> tuple[int, int, int, bool]:
        """BLOCK_M, BLOCK_N, BLOCK_K and whether the dots take fp32 operands."""
        if INTERPRETED:  # the interpreter pays per program: few, large ones
            return 32, min(128, triton.next_power_of_2(max(self.inter, self.hidden))), 64, True
        per_expert = pairs / min(self.num_experts, pairs)
        block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
        return block_m, 64, 64, dtype == torch.float32

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """sum over each token's k experts of weight * expert(x) [T, H], in x's dtype."""
        rows, k = ids.shape
        hidden, inter = self.hidden, self.inter
        if rows == 0:
            return x.new_zeros(0, hidden)
        x = x.contiguous()
        pairs = rows * k
        block_m, block_n, block_k, dot_fp32 = self.blocks(pairs, x.dtype)
        sorted_pairs, block_expert = align(ids, self.num_experts, block_m)
        act = torch.empty(sorted_pairs.numel(), inter, dtype=x.dtype, device=x.device)
        # the product's dtype as transformers multiplies: fp32 with Mixtral's fp32 weights, else the model's
        out = torch.empty(pairs, hidden, dtype=torch.promote_types(x.dtype, weights.dtype), device=x.device)
        grid_m = block_expert.numel()
        alpha, limit = self.swiglu or (1.0, 0.0)
        gate_up_bias = self.gate_up if self.gate_up_bias is None else self.gate_up_bias  # unread without BIAS
        down_bias = self.down if self.down_bias is None else self.down_bias
        _gate_up_kernel[(grid_m, triton.cdiv(inter, block_n))](
            x, self.gate_up, gate_up_bias, sorted_pairs, block_expert, act, pairs, hidden, inter, x.stride(0), alpha,
            limit, TOP_K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_FP32=dot_fp32,
            BIAS=self.gate_up_bias is not None, SWIGLU=self.swiglu is not None, num_warps=4,
        )  # fmt: skip
        _down_kernel[(grid_m, triton.cdiv(hidden, block_n))](
            act, self.down, down_bias, sorted_pairs, block_expert, weights.reshape(-1).float().contiguous(), out,
            pairs, hidden, inter, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_FP32=dot_fp32,
            BIAS=self.down_bias is not None, num_warps=4,
        )  # fmt: skip
        return out.view(rows, k, hidden).sum(dim=1).to(x.dtype)
