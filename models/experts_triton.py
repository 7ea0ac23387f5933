"""A decode step's expert bookkeeping in Triton: the CUDA kernels of the ops ``megacispo::permute_pairs``,
``megacispo::swiglu`` and ``megacispo::combine_pairs`` (models/experts.py, where each op's composite
of torch ops says what it computes and serves the CPU and tracing).

A decode step's experts (``grouped_expert_products``) run the b * k (token, chosen expert) pairs
sorted by expert through two grouped products. Around them torch alone launches eight kernels: the
token of each sorted pair (a division), its row (a gather), silu and its product, a zeroed buffer for
the pairs of other ranks' experts, the scatter back to pair order, the routing weights' cast and the
weighted sum with the residual. Here they are three kernels, with each row read and written once:

- ``_permute_pairs_kernel``: the token row of each sorted pair, and where each pair went (its sorted
  position, -1 for another rank's expert, whose rows no product computes);
- ``_swiglu_kernel``: silu(gate) * up of the first product's output, on the rows it computed;
- ``_combine_pairs_kernel``: per token, the residual plus its pairs' outputs weighted by the routing
  weights, a pair of another rank's expert adding 0.

They round where the composites round (silu's output, the routing weights to the tokens' dtype), so
a bf16 step gives the composites' numbers. On a machine without CUDA they run in Triton's interpreter
when TRITON_INTERPRET=1 is set before this module is imported (tests); the kernels use only Triton's
builtins, as models/lightning_triton.py explains, which also says what meta tensors do.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: triton ships with CUDA builds of torch and the test extra.
    triton = None

__all__ = ["INTERPRETED", "combine_pairs_triton", "permute_pairs_triton", "swiglu_triton"]

_jit = triton.jit if triton is not None else (lambda fn: fn)

# Columns one program moves: a decode row (H = 6144 at M1) is a few programs wide.
_MAX_BLOCK = 1024


@_jit
def _permute_pairs_kernel(
    tokens_ptr,  # [n, H]
    order_ptr,  # [P] int64: the pair at each sorted position (pair p = token p // TOPK's slot p % TOPK)
    sorted_experts_ptr,  # [P] int64: the expert of each sorted position, num_experts or more: another rank's
    rows_ptr,  # [P, H] out: the token row of each local pair, at its sorted position
    positions_ptr,  # [P] int64 out: each pair's sorted position, -1 for another rank's expert
    hidden,
    num_experts,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One sorted position, BLOCK columns of its row."""
    position = tl.program_id(0)
    block = tl.program_id(1)
    pair = tl.load(order_ptr + position)
    local = tl.load(sorted_experts_ptr + position) < num_experts
    if block == 0:
        tl.store(positions_ptr + pair, tl.where(local, position.to(tl.int64), -1))
    columns = block * BLOCK + tl.arange(0, BLOCK)
    mask = columns < tl.where(local, hidden, 0)  # no columns for another rank's pair
    row = tl.load(tokens_ptr + (pair // TOPK) * hidden + columns, mask=mask)
    tl.store(rows_ptr + position.to(tl.int64) * hidden + columns, row, mask=mask)


@_jit
def _swiglu_kernel(
    projected_ptr,  # [m, 2F]: gate | up, rows sorted by expert
    ends_ptr,  # [E] int32: where each expert's rows end; rows past the last are no product's
    out_ptr,  # [m, F]
    width,  # F
    num_experts,
    BLOCK: tl.constexpr,
):
    """One row, BLOCK of its F columns: silu(gate) rounded to the output's dtype (as torch's silu
    returns it), times up, in fp32. A row past the groups (another rank's pair) is skipped."""
    row = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < tl.where(row < tl.load(ends_ptr + num_experts - 1), width, 0)
    gate = tl.load(projected_ptr + row * 2 * width + columns, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(projected_ptr + row * 2 * width + width + columns, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * width + columns, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _combine_pairs_kernel(
    tokens_ptr,  # [n, H]
    probs_ptr,  # [n, TOPK]: routing weights
    outputs_ptr,  # [P, H]: the experts' output rows, by sorted position
    positions_ptr,  # [P] int64: each pair's sorted position, -1 for another rank's expert
    out_ptr,  # [n, H] out
    hidden,
    residual_scale,
    update_scale,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One token, BLOCK columns: residual_scale * token + update_scale * sum over its pairs of the
    routing weight (rounded to the tokens' dtype) times the pair's output row, in fp32."""
    token = tl.program_id(0).to(tl.int64)
    columns = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = columns < hidden
    summed = tl.full([BLOCK], 0.0, tl.float32)
    for slot in range(TOPK):
        position = tl.load(positions_ptr + token * TOPK + slot)
        weight = tl.load(probs_ptr + token * TOPK + slot).to(out_ptr.dtype.element_ty).to(tl.float32)
        computed = columns < tl.where(position >= 0, hidden, 0)  # no columns for another rank's pair
        row = tl.load(outputs_ptr + tl.maximum(position, 0) * hidden + columns, mask=computed, other=0.0)
        summed += weight * row.to(tl.float32)
    residual = tl.load(tokens_ptr + token * hidden + columns, mask=mask, other=0.0).to(tl.float32)
    combined = residual_scale * residual + update_scale * summed
    tl.store(out_ptr + token * hidden + columns, combined.to(out_ptr.dtype.element_ty), mask=mask)


# True when the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 when this module was imported).
INTERPRETED = triton is not None and not isinstance(_permute_pairs_kernel, triton.JITFunction)


def permute_pairs_triton(
    tokens: torch.Tensor, sorted_experts: torch.Tensor, order: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``megacispo::permute_pairs``' kernel: tokens [n, H]; sorted_experts, order [P] int64 (P = n * k)
    -> (rows [P, H], positions [P] int64). Rows of other ranks' experts are left unwritten."""
    _check_runtime(tokens)
    batch, hidden = tokens.shape
    pairs = order.numel()
    rows = tokens.new_empty(pairs, hidden)
    positions = torch.empty_like(order)
    block = _block(hidden)
    _permute_pairs_kernel[(pairs, triton.cdiv(hidden, block))](
        tokens.contiguous(), order, sorted_experts, rows, positions, hidden, num_experts,
        TOPK=pairs // batch, BLOCK=block,
    )
    return rows, positions


def swiglu_triton(projected: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``megacispo::swiglu``'s kernel: projected [m, 2F] (gate | up), ends [E] -> [m, F], the rows past
    ends[-1] left unwritten."""
    _check_runtime(projected)
    rows, width = projected.shape[0], projected.shape[1] // 2
    out = projected.new_empty(rows, width)
    block = _block(width)
    _swiglu_kernel[(rows, triton.cdiv(width, block))](
        projected.contiguous(), ends, out, width, ends.numel(), BLOCK=block
    )
    return out


def combine_pairs_triton(
    tokens: torch.Tensor, probs: torch.Tensor, expert_outputs: torch.Tensor, positions: torch.Tensor,
    residual_scale: float, update_scale: float,
) -> torch.Tensor:
    """``megacispo::combine_pairs``' kernel: tokens [n, H], probs [n, k], expert_outputs [P, H],
    positions [P] -> [n, H]."""
    _check_runtime(tokens)
    batch, hidden = tokens.shape
    out = torch.empty_like(tokens)
    block = _block(hidden)
    _combine_pairs_kernel[(batch, triton.cdiv(hidden, block))](
        tokens.contiguous(), probs.contiguous(), expert_outputs.contiguous(), positions, out, hidden,
        residual_scale, update_scale, TOPK=probs.shape[1], BLOCK=block,
    )
    return out


def _block(columns: int) -> int:
    return min(_MAX_BLOCK, triton.next_power_of_2(columns))


def _check_runtime(tensor: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError(
            "the decode step's expert kernels need the triton package (it comes with CUDA builds of torch); "
            "on a CPU the ops run their composites (models/experts.py)"
        )
    if not INTERPRETED and tensor.device.type == "cpu":
        raise RuntimeError(
            f"the decode step's expert kernels run Triton and need a CUDA GPU, got a tensor on {tensor.device}; "
            "on a CPU call the ops (torch.ops.megacispo.*), which run their composites, or for tests set "
            "TRITON_INTERPRET=1 before importing this module"
        )
