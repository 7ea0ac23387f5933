"""Lightning attention in Triton: block-wise forward and backward kernels for CUDA GPUs.

Computes what `lightning_attention` (models/lightning.py) computes, per head h with rate s_h:

    S_t = exp(-s_h) * S_(t-1) + k_t^T v_t        (S is d x d)
    o_t = q_t S_t

Block-wise (Lightning Attention-2). A block holds L <= B consecutive tokens of one document (only a
document's last block is shorter than B); S_in is the state entering it, and i, j index its rows:

    o_i    = sum_(j <= i) exp(-s (i - j)) (q_i . k_j) v_j     intra-block "left product"
           + exp(-s (i + 1)) q_i S_in                           inter-block "right product"
    S_out  = exp(-s L) S_in + sum_j exp(-s (L - 1 - j)) k_j^T v_j

Using the real length L of a short last block (not B) is what keeps the decay exact at any length.

Two kernels do all the work:

* `_state_scan_kernel` walks a document's blocks in order and writes the state entering each block
  (the only sequential part: grid documents x heads x state tiles). Run in reverse on (q, grad_out)
  instead of (k, v), the same recurrence gives the gradient w.r.t. the state leaving each block.
* `_block_output_kernel` is the per-block formula for o_i above, with every block independent
  (grid blocks x heads x column tiles). The backward of a causal decayed product is an anti-causal
  one, so the same kernel also gives grad q, grad k and grad v (see _LightningTritonFunction). Its
  two products over the d features (the scores q k^T and the state's q S_in) accumulate a slice
  of the features at a time, so no program holds all d of q and k in registers.

Backward recomputes the per-block states rather than saving them: they are [blocks, h, d, d] fp32,
more than q, k and v together at B = 64, d = 128. All products accumulate in fp32 (see _dot); with
bf16 inputs the fp32 scores and states are rounded to bf16 for the second product, as
flash-attention kernels do.

Packed sequences (cu_seqlens) run natively: the kernels read document offsets from tables, and a
batch of b equal-length rows is the packed case with b documents of length n.

On a machine without CUDA the kernels run in Triton's interpreter when TRITON_INTERPRET=1 is set
before this module is imported (tests); otherwise calling lightning_attention_triton on CPU
tensors raises. On meta tensors the launches happen with shapes alone: the ahead-of-time compile
(megacispo.testing.triton_aot) records them and compiles each for sm_90 and sm_80.

Shapes: T tokens of all documents together, h heads, d head dim, G blocks of all documents,
B block size, D documents.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import torch

from megacispo.models.lightning_checks import check_decay, check_qkv, check_state, document_lengths

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: triton ships with CUDA builds of torch and the test extra.
    triton = None

__all__ = ["INTERPRETED", "lightning_attention_triton"]

# Without triton the kernels below stay plain (never called) functions, so this module still imports.
_jit = triton.jit if triton is not None else (lambda fn: fn)

# Tiles and blocks are powers of two >= 16: tl.dot needs every dimension >= 16 on the GPU. The sizes
# keep every kernel free of register spills on sm_90 and sm_80 at d = 128 in fp32 (three TF32
# products per dot) and bf16, with 8 warps; docs/reports/benchmarks.md has their registers.
_MIN_DOT_DIM = 16
_SCAN_TILE = 32  # the state's rows and columns per program
_OUTPUT_TILE = 32  # output columns per program
_FEATURES = 16  # features per step of the block-output kernel's products
_NUM_WARPS = 8


@_jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b, accumulated in fp32 (acc None: a @ b). bf16 operands use bf16 tensor cores; fp32
    operands use three TF32 products (tf32x3, about fp32 accuracy): plain TF32 would miss the 1e-4
    parity with the fp32 reference, and IEEE fp32 falls back to FMA loops that spill heavily.

    UPCAST is for Triton's interpreter, which cannot multiply bf16 (it holds the bits as uint16): the
    same bf16-rounded operands go in as fp32, whose products are exact, as on bf16 tensor cores.
    """
    if UPCAST:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32x3")
    else:
        result = tl.dot(a, b, acc, input_precision="tf32x3")
    return result


@_jit
def _state_scan_kernel(
    x_ptr,  # [T, h, d]: keys (forward) or queries (REVERSE)
    y_ptr,  # [T, h, d]: values (forward) or grad_out (REVERSE)
    rates_ptr,  # [h] fp32 decay rates s_h
    cu_seqlens_ptr,  # [D + 1] int32: first token of each document
    cu_blocks_ptr,  # [D + 1] int32: first block of each document
    initial_ptr,  # [D, h, d, d] fp32 state before the first block (last, REVERSE), or None
    block_states_ptr,  # [G, h, d, d] fp32 out: state entering each block (leaving it, REVERSE)
    final_ptr,  # [D, h, d, d] fp32 out: state after the last block (before the first, REVERSE)
    num_heads,
    head_dim,
    BLOCK: tl.constexpr,  # B
    HEAD_DIM: tl.constexpr,  # d padded to a power of two >= 16
    TILE_X: tl.constexpr,  # state rows (x features) per program
    TILE_Y: tl.constexpr,  # state columns (y features) per program
    REVERSE: tl.constexpr,
    HAS_INITIAL: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,  # see _dot
):
    """One document, one head, one [TILE_X, TILE_Y] tile of the d x d state; blocks in sequence.

    Forward (x = k, y = v), blocks first to last, S = state entering the block:
        S <- exp(-s L) S + sum_j exp(-s (L - 1 - j)) k_j^T v_j     (key j decays to the block's end)
    REVERSE (x = q, y = grad_out), blocks last to first, S = grad w.r.t. the state leaving the block:
        S <- exp(-s L) S + sum_i exp(-s (i + 1)) q_i^T grad_o_i    (= grad w.r.t. the state entering)
    because S_in reaches o_i through exp(-s (i + 1)) q_i S_in and the next block through exp(-s L).
    """
    doc = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    x_cols = (tile // (HEAD_DIM // TILE_Y)) * TILE_X + tl.arange(0, TILE_X)
    y_cols = (tile % (HEAD_DIM // TILE_Y)) * TILE_Y + tl.arange(0, TILE_Y)
    rows = tl.arange(0, BLOCK)
    rate = tl.load(rates_ptr + head)
    doc_start = tl.load(cu_seqlens_ptr + doc)
    doc_end = tl.load(cu_seqlens_ptr + doc + 1)
    first_block = tl.load(cu_blocks_ptr + doc)
    num_blocks = tl.load(cu_blocks_ptr + doc + 1) - first_block

    token_stride = num_heads * head_dim
    state_stride = num_heads * head_dim * head_dim  # one [h, d, d] per block or document
    tile_offsets = head * head_dim * head_dim + x_cols[:, None] * head_dim + y_cols[None, :]
    tile_mask = (x_cols[:, None] < head_dim) & (y_cols[None, :] < head_dim)
    if HAS_INITIAL:
        state = tl.load(initial_ptr + doc.to(tl.int64) * state_stride + tile_offsets, mask=tile_mask, other=0.0)
    else:
        # tl.full, not tl.zeros: library @triton.jit helpers such as tl.zeros only run in the
        # interpreter if TRITON_INTERPRET was set before triton itself was imported.
        state = tl.full([TILE_X, TILE_Y], 0.0, tl.float32)

    for step in range(num_blocks):
        if REVERSE:
            block = num_blocks - 1 - step
        else:
            block = step
        start = doc_start + block * BLOCK
        length = tl.minimum(doc_end - start, BLOCK)  # L
        block_state_offsets = (first_block + block).to(tl.int64) * state_stride + tile_offsets
        tl.store(block_states_ptr + block_state_offsets, state, mask=tile_mask)

        row_mask = rows < length
        token_offsets = (start + rows).to(tl.int64)[:, None] * token_stride + head * head_dim
        x_mask = row_mask[:, None] & (x_cols[None, :] < head_dim)
        y_mask = row_mask[:, None] & (y_cols[None, :] < head_dim)
        x = tl.load(x_ptr + token_offsets + x_cols[None, :], mask=x_mask, other=0.0)  # [B, TILE_X]
        y = tl.load(y_ptr + token_offsets + y_cols[None, :], mask=y_mask, other=0.0)  # [B, TILE_Y]
        if REVERSE:
            row_decay = tl.exp(-rate * (rows + 1).to(tl.float32))
        else:
            # Rows past L hold zero keys; the clamp only keeps their factor finite.
            row_decay = tl.exp(-rate * tl.maximum(length - 1 - rows, 0).to(tl.float32))
        decayed_x = (x * row_decay[:, None]).to(x.dtype)  # [B, TILE_X]
        # [TILE_X, TILE_Y] fp32: the state decayed over the block, plus the block's keys and values.
        state = _dot(tl.trans(decayed_x), y, tl.exp(-rate * length.to(tl.float32)) * state, UPCAST_DOTS)

    tl.store(final_ptr + doc.to(tl.int64) * state_stride + tile_offsets, state, mask=tile_mask)


@_jit
def _block_output_kernel(
    a_ptr,  # [T, h, d]: row operand (q for the output)
    b_ptr,  # [T, h, d]: column operand of the scores (k for the output)
    c_ptr,  # [T, h, d]: what the scores weight (v for the output)
    states_ptr,  # [G, h, d, d] fp32: the state paired with each block
    out_ptr,  # [T, h, d]
    rates_ptr,  # [h] fp32 decay rates s_h
    cu_seqlens_ptr,  # [D + 1] int32: first token of each document
    cu_blocks_ptr,  # [D + 1] int32: first block of each document
    block_docs_ptr,  # [G] int32: document of each block
    num_heads,
    head_dim,
    state_row_stride,  # (d, 1) reads each state as stored, (1, d) reads its transpose
    state_col_stride,
    BLOCK: tl.constexpr,  # B
    HEAD_DIM: tl.constexpr,  # d padded to a power of two >= 16
    TILE: tl.constexpr,  # output columns per program
    FEATURES: tl.constexpr,  # features of a and b (rows of the state) per step of the products
    ANTI_CAUSAL: tl.constexpr,
    UPCAST_DOTS: tl.constexpr,  # see _dot
):
    """One block, one head, TILE output columns:

        causal:       out_i = sum_(j <= i) exp(-s (i - j)) (a_i . b_j) c_j + exp(-s (i + 1)) a_i state
        ANTI_CAUSAL:  out_i = sum_(j >= i) exp(-s (j - i)) (a_i . b_j) c_j + exp(-s (L - 1 - i)) a_i state

    The causal form with (a, b, c, state) = (q, k, v, S_in) is the block's output; the others are its
    gradients (see _LightningTritonFunction.backward). The scores a b^T and the state's product
    a state both sum over the d features: they accumulate FEATURES at a time, so a program holds a
    [B, FEATURES] slice of a and b, not all d of them.
    """
    block = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    doc = tl.load(block_docs_ptr + block)
    start = tl.load(cu_seqlens_ptr + doc) + (block - tl.load(cu_blocks_ptr + doc)) * BLOCK
    length = tl.minimum(tl.load(cu_seqlens_ptr + doc + 1) - start, BLOCK)  # L
    rate = tl.load(rates_ptr + head)

    rows = tl.arange(0, BLOCK)
    cols = tile * TILE + tl.arange(0, TILE)
    row_mask = rows < length
    token_offsets = (start + rows).to(tl.int64)[:, None] * (num_heads * head_dim) + head * head_dim
    state_offsets = (block.to(tl.int64) * num_heads + head) * head_dim * head_dim
    # Right product: how far row i is from the state (the block's start, or its end if anti-causal).
    if ANTI_CAUSAL:
        row_decay = tl.exp(-rate * tl.maximum(length - 1 - rows, 0).to(tl.float32))
    else:
        row_decay = tl.exp(-rate * (rows + 1).to(tl.float32))

    scores = tl.full([BLOCK, BLOCK], 0.0, tl.float32)
    carried = tl.full([BLOCK, TILE], 0.0, tl.float32)  # the right product
    for first in range(0, HEAD_DIM, FEATURES):
        features = first + tl.arange(0, FEATURES)
        feature_mask = row_mask[:, None] & (features[None, :] < head_dim)
        a = tl.load(a_ptr + token_offsets + features[None, :], mask=feature_mask, other=0.0)  # [B, FEATURES]
        b = tl.load(b_ptr + token_offsets + features[None, :], mask=feature_mask, other=0.0)  # [B, FEATURES]
        state = tl.load(
            states_ptr + state_offsets + features[:, None] * state_row_stride + cols[None, :] * state_col_stride,
            mask=(features[:, None] < head_dim) & (cols[None, :] < head_dim),
            other=0.0,
        )  # [FEATURES, TILE] fp32
        scores = _dot(a, tl.trans(b), scores, UPCAST_DOTS)
        carried = _dot((a * row_decay[:, None]).to(a.dtype), state.to(a.dtype), carried, UPCAST_DOTS)

    # Left product: decayed scores over the block, zero on the far side of the diagonal.
    lag = rows[:, None] - rows[None, :]  # i - j
    if ANTI_CAUSAL:
        lag = -lag
    scores = tl.where(lag >= 0, scores * tl.exp(-rate * tl.maximum(lag, 0).to(tl.float32)), 0.0)
    out_mask = row_mask[:, None] & (cols[None, :] < head_dim)
    c = tl.load(c_ptr + token_offsets + cols[None, :], mask=out_mask, other=0.0)  # [B, TILE]
    out = _dot(scores.to(c.dtype), c, carried, UPCAST_DOTS)
    tl.store(out_ptr + token_offsets + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)


# True when the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 when this module was imported).
INTERPRETED = triton is not None and not isinstance(_state_scan_kernel, triton.JITFunction)


def lightning_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    block_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lightning attention with Triton kernels; same contract as models.lightning.lightning_attention.

    q, k, v: [b, n, h, d] fp32 or bf16 on a CUDA GPU; decay: [h] positive rates s_h.
    Without cu_seqlens: initial_state and the returned final state are [b, h, d, d].
    With cu_seqlens (int [D + 1] document offsets, batch 1): the state resets at every document start,
    and initial_state / final state are [D, h, d, d]. initial_state None means zeros.
    block_size: B, a power of two >= 16. Gradients flow to q, k, v and initial_state.
    Returns (out [b, n, h, d], final_state) in q's dtype.
    """
    _check_runtime(q)
    check_qkv(q, k, v)
    batch, seq_len, num_heads, head_dim = q.shape
    check_decay(decay, num_heads)
    if not isinstance(block_size, int) or block_size < _MIN_DOT_DIM or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= {_MIN_DOT_DIM} (tl.dot tiles), got {block_size!r}")
    doc_lengths = [seq_len] * batch if cu_seqlens is None else document_lengths(cu_seqlens, batch, seq_len)
    if initial_state is not None:
        check_state("initial_state", initial_state, (len(doc_lengths), num_heads, head_dim, head_dim))
        if initial_state.dtype != q.dtype:
            raise ValueError(f"initial_state dtype must be q's {q.dtype}, got {initial_state.dtype}")
    blocks = _DocumentBlocks.build(tuple(doc_lengths), block_size, q.device)
    rates = decay.detach().to(device=q.device, dtype=torch.float32).contiguous()
    # Rows of a contiguous [b, n, h, d] batch are documents laid end to end: the packed layout.
    tokens = [x.contiguous().view(batch * seq_len, num_heads, head_dim) for x in (q, k, v)]
    out, final_state = _LightningTritonFunction.apply(*tokens, initial_state, rates, blocks)
    return out.view_as(q), final_state


def _check_runtime(q: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError(
            "lightning_attention_triton needs the triton package (it comes with CUDA builds of torch); "
            "on a CPU use megacispo.models.lightning.lightning_attention"
        )
    if not INTERPRETED and q.device.type == "cpu":
        raise RuntimeError(
            f"lightning_attention_triton runs Triton kernels and needs a CUDA GPU, got q on {q.device}; "
            "on a CPU use megacispo.models.lightning.lightning_attention, or for tests set TRITON_INTERPRET=1 "
            "before importing this module to run the kernels in Triton's interpreter"
        )


@dataclass(frozen=True)
class _DocumentBlocks:
    """Where every block of every document starts: the tables both kernels index."""

    block_size: int
    num_blocks: int  # G
    cu_seqlens: torch.Tensor  # [D + 1] int32: first token of each document
    cu_blocks: torch.Tensor  # [D + 1] int32: first block of each document
    block_docs: torch.Tensor  # [G] int32: document of each block

    @property
    def num_docs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def build(doc_lengths: tuple[int, ...], block_size: int, device: torch.device) -> _DocumentBlocks:
        """Cached: every lightning layer of a model step sees the same document lengths. Built on the
        host from the Python lengths (no tensor read back), then moved to ``device`` once."""
        blocks_per_doc = [-(-length // block_size) for length in doc_lengths]
        block_docs = [doc for doc, count in enumerate(blocks_per_doc) for _ in range(count)]

        def table(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        return _DocumentBlocks(
            block_size=block_size,
            num_blocks=len(block_docs),
            cu_seqlens=table([0, *itertools.accumulate(doc_lengths)]),
            cu_blocks=table([0, *itertools.accumulate(blocks_per_doc)]),
            block_docs=table(block_docs),
        )


def _padded_head_dim(head_dim: int) -> int:
    return max(_MIN_DOT_DIM, triton.next_power_of_2(head_dim))


def _scan_states(
    x: torch.Tensor,
    y: torch.Tensor,
    rates: torch.Tensor,
    blocks: _DocumentBlocks,
    initial: torch.Tensor | None,
    reverse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run _state_scan_kernel: x, y [T, h, d]; initial [D, h, d, d] or None.

    Returns (per-block states [G, h, d, d], final states [D, h, d, d]), both fp32.
    """
    _, num_heads, head_dim = x.shape
    padded = _padded_head_dim(head_dim)
    tile = min(padded, _SCAN_TILE)
    block_states = x.new_empty(blocks.num_blocks, num_heads, head_dim, head_dim, dtype=torch.float32)
    final = x.new_empty(blocks.num_docs, num_heads, head_dim, head_dim, dtype=torch.float32)
    grid = (blocks.num_docs, num_heads, (padded // tile) ** 2)
    _state_scan_kernel[grid](
        x, y, rates, blocks.cu_seqlens, blocks.cu_blocks,
        None if initial is None else initial.float().contiguous(), block_states, final,
        num_heads, head_dim,
        BLOCK=blocks.block_size, HEAD_DIM=padded, TILE_X=tile, TILE_Y=tile,
        REVERSE=reverse, HAS_INITIAL=initial is not None, UPCAST_DOTS=INTERPRETED,
        num_warps=_NUM_WARPS,
    )  # fmt: skip
    return block_states, final


def _block_outputs(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    states: torch.Tensor,
    rates: torch.Tensor,
    blocks: _DocumentBlocks,
    transpose_states: bool,
    anti_causal: bool,
) -> torch.Tensor:
    """Run _block_output_kernel: a, b, c [T, h, d], states [G, h, d, d] fp32 -> [T, h, d] in a's dtype."""
    _, num_heads, head_dim = a.shape
    padded = _padded_head_dim(head_dim)
    tile = min(padded, _OUTPUT_TILE)
    out = torch.empty_like(a)
    row_stride, col_stride = (1, head_dim) if transpose_states else (head_dim, 1)
    grid = (blocks.num_blocks, num_heads, padded // tile)
    _block_output_kernel[grid](
        a, b, c, states, out, rates, blocks.cu_seqlens, blocks.cu_blocks, blocks.block_docs,
        num_heads, head_dim, row_stride, col_stride,
        BLOCK=blocks.block_size, HEAD_DIM=padded, TILE=tile, FEATURES=min(padded, _FEATURES), ANTI_CAUSAL=anti_causal,
        UPCAST_DOTS=INTERPRETED,
        num_warps=_NUM_WARPS,
    )  # fmt: skip
    return out


class _LightningTritonFunction(torch.autograd.Function):
    """Token tensors [T, h, d] in, (out [T, h, d], final states [D, h, d, d]) out.

    Saves only q, k, v and the initial states; backward recomputes the per-block states.
    """

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        initial_states: torch.Tensor | None,
        rates: torch.Tensor,
        blocks: _DocumentBlocks,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        states, final_states = _scan_states(k, v, rates, blocks, initial_states, reverse=False)
        out = _block_outputs(q, k, v, states, rates, blocks, transpose_states=False, anti_causal=False)
        ctx.save_for_backward(q, k, v, initial_states, rates)
        ctx.blocks = blocks
        return out, final_states.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, grad_final: torch.Tensor):
        q, k, v, initial_states, rates = ctx.saved_tensors
        blocks = ctx.blocks
        grad_out = grad_out.to(q.dtype).contiguous()
        # grad q: o_i depends on q_i through the causal product with k, v and through S_in:
        #   grad q_i = sum_(j <= i) exp(-s (i - j)) (grad_o_i . v_j) k_j + exp(-s (i + 1)) grad_o_i S_in^T
        states, _ = _scan_states(k, v, rates, blocks, initial_states, reverse=False)
        grad_q = _block_outputs(grad_out, v, k, states, rates, blocks, transpose_states=True, anti_causal=False)
        del states
        # grad_leaving[block] = grad w.r.t. the state leaving the block (grad S_out); the reverse
        # scan ends at the grad w.r.t. each document's initial state.
        grad_leaving, grad_initial = _scan_states(q, grad_out, rates, blocks, grad_final, reverse=True)
        # k_j and v_j reach the rows i >= j of their block, and S_out through exp(-s (L - 1 - j)) k_j^T v_j:
        #   grad k_j = sum_(i >= j) exp(-s (i - j)) (grad_o_i . v_j) q_i + exp(-s (L - 1 - j)) v_j grad_S_out^T
        #   grad v_j = sum_(i >= j) exp(-s (i - j)) (q_i . k_j) grad_o_i + exp(-s (L - 1 - j)) k_j grad_S_out
        grad_k = _block_outputs(v, grad_out, q, grad_leaving, rates, blocks, transpose_states=True, anti_causal=True)
        grad_v = _block_outputs(k, q, grad_out, grad_leaving, rates, blocks, transpose_states=False, anti_causal=True)
        grad_initial = None if initial_states is None else grad_initial.to(initial_states.dtype)
        return grad_q, grad_k, grad_v, grad_initial, None, None
