"""Lightning attention (MiniMax-01 / Lightning Attention-2) in pure PyTorch.

Per head h with decay rate s_h > 0 and a d x d state S (no 1/sqrt(d) scaling, no GQA):

    S_t = exp(-s_h) * S_(t-1) + k_t^T v_t
    o_t = q_t S_t

`lightning_attention_reference` runs this recurrence token by token and is the ground truth.
`lightning_attention` computes the same thing block-wise (Lightning Attention-2): a masked
quadratic "left product" inside each block of B tokens and a "right product" with the running
state between blocks, O(n B d + n d^2) time. `lightning_decode_step` advances one token in
O(d^2) per head.

Layout. Every document (the whole sequence, or each cu_seqlens segment) is padded with zero tokens
at its *front* up to a multiple of B, and the padded documents are laid end to end, so every block
is full and belongs to exactly one document. Zero keys and values add nothing to the state, so the
state at the end of a document's last block is exactly its final state, with the same decay
factors for every block; the last-block off-by-one (using B instead of the real block length for
the inter-block decay) cannot occur. The state is reset at the first block of each document. An
initial state enters as a separate linear term, exp(-s (p + 1)) q_p S_0 for the token at position
p of its document, because folding it into the padded front would need exp(+s * padding), which
overflows. Packed sequences thus cost at most B - 1 padding tokens per document and need no
Python loop over documents: documents are masks in the block-to-block recurrence.

Chunks. Blocks are processed in chunks of CHUNK_TOKENS tokens: a chunk gathers its blocks, runs
the state recurrence across them as one masked [G, G] matmul of block decay powers, and carries
one d x d state per head to the next chunk. Temporaries stay a few MiB whatever n is.

Gradients. A custom autograd.Function saves q, k, v, the initial state and one state per chunk,
and recomputes the [B, B] block scores and the block states in backward, chunk by chunk in
reverse. Plain autograd through the same forward keeps about 3x more for backward
(benchmarks/lightning_attention.py measures both; see docs/reports/benchmarks.md). The decay rates get
no gradient: they are fixed buffers derived from the layer index.

Shapes: b batch, n tokens, h heads, d head dim, B block size, nb blocks, G blocks in a chunk,
D documents.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from megacispo.models.lightning_checks import check_decay, check_decay_shape, check_qkv, check_state, document_lengths

__all__ = [
    "CHUNK_TOKENS",
    "lightning_attention",
    "lightning_attention_reference",
    "lightning_decay_rates",
    "lightning_decode_step",
    "lightning_state_step",
    "lightning_step_decay",
]

# Blocks are processed in chunks of about this many tokens (at least one block). Small chunks keep
# the temporaries a few MiB: in cache, and reused by the allocator (on a CPU, tensors over glibc's
# 32 MiB mmap threshold are page-faulted in afresh on every call, which doubled the step time at
# 16k tokens). Larger chunks mean fewer, larger ops, which suits GPUs.
CHUNK_TOKENS = 1024


def lightning_decay_rates(
    num_heads: int,
    layer_idx: int,
    num_layers: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Decay rates s_h [num_heads] of one lightning-attention layer, bit-identical to HF in fp32.

    transformers' MiniMaxLightningAttention.get_slope_rate computes

        base   = 1 / 2 ** (8 / num_heads)                          # Python float (fp64)
        factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5     # Python float (fp64)
        s_h    = fp32(base) ** fp32(h + 1) * fp32(factor)           # torch, default dtype fp32

    i.e. MODEL.md's 2^(-8 (h+1) / nh) * (1 - l / (L - 1) + 1e-5) with 1e-5 added to the divisor.
    That divisor also defines the single-layer model: num_layers == 1 gives factor 1 + 1e-5, as
    in HF. layer_idx is the index among all layers (softmax layers included). With dtype=float64
    the same formula is evaluated in fp64. The rates are made on ``device``.
    """
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer_idx must be in [0, num_layers={num_layers}), got {layer_idx}")
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    base = 1 / (2 ** (8 / num_heads))
    factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    exponent = torch.arange(1, num_heads + 1, dtype=dtype, device=device)
    return torch.tensor(base, dtype=dtype, device=device) ** exponent * torch.tensor(factor, dtype=dtype, device=device)


def lightning_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence, one token at a time (ground truth for tests; O(n) Python steps).

    q, k, v: [b, n, h, d]; decay: [h]; initial_state: [b, h, d, d] or None (zeros).
    Returns (out [b, n, h, d], final_state [b, h, d, d]).
    """
    check_qkv(q, k, v)
    check_decay(decay, q.shape[2])
    batch, seq_len, num_heads, head_dim = q.shape
    state_shape = (batch, num_heads, head_dim, head_dim)
    if initial_state is None:
        state = q.new_zeros(state_shape)
    else:
        check_state("initial_state", initial_state, state_shape)
        state = initial_state
    outputs = []
    for t in range(seq_len):
        out_t, state = lightning_decode_step(q[:, t], k[:, t], v[:, t], decay, state)
        outputs.append(out_t)
    return torch.stack(outputs, dim=1), state


def lightning_decode_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance the state by one token: O(d^2) per head.

    q, k, v: [b, h, d]; decay: [h]; state: [b, h, d, d]. Returns (out [b, h, d], new_state); the
    state passed in is left as it was. Only shapes are checked: checking the decay values would
    sync the device every token.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, heads, head_dim] for one token, got shape {tuple(q.shape)}")
    for name, tensor in (("k", k), ("v", v)):
        if tensor.shape != q.shape:
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {tuple(tensor.shape)}")
    batch, num_heads, head_dim = q.shape
    check_decay_shape(decay, num_heads)
    check_state("state", state, (batch, num_heads, head_dim, head_dim))
    return lightning_state_step(q, k, v, lightning_step_decay(decay, state.dtype), state.clone())


def lightning_step_decay(decay: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """exp(-s_h) [h, 1, 1] in ``dtype`` (computed in fp64): one token's decay of the state."""
    return torch.exp(-decay.double()).to(dtype)[:, None, None]


def lightning_state_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step_decay: torch.Tensor, state: torch.Tensor,
    live: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``lightning_decode_step`` without the checks, with the decay factors exp(-s_h) [h, 1, 1]
    precomputed by ``lightning_step_decay``: the per-token path of a decoder that keeps them. The
    state [b, h, d, d] advances in place (and is returned): three kernels, no new state per token.
    ``live`` [b] bool: only these rows advance; the others' states stay exactly as they are (decay 1,
    no key), two kernels more (``InferenceCache.live_rows``)."""
    batch, heads, dim = q.shape
    flat_state = state.view(batch * heads, dim, dim)
    if live is not None:
        step_decay = torch.where(live[:, None, None, None], step_decay, 1.0)
        k = k * live[:, None, None]
    state.mul_(step_decay)
    flat_state.baddbmm_(k.reshape(batch * heads, dim, 1), v.reshape(batch * heads, 1, dim))
    out = torch.bmm(q.reshape(batch * heads, 1, dim), flat_state).view(batch, heads, dim)
    return out, state


def lightning_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    block_size: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise lightning attention with a hand-written backward.

    q, k, v: [b, n, h, d]; decay: [h] positive rates s_h.
    Without cu_seqlens: initial_state and the returned final state are [b, h, d, d].
    With cu_seqlens (int [D + 1], cumulative document offsets as in flash-attn varlen, batch 1):
    the state resets at every document start, and initial_state / final state are [D, h, d, d].
    initial_state None means zeros. Gradients flow to q, k, v and initial_state, not to decay.
    block_size: 256 as in the public code; on a CPU 64 to 128 is faster (docs/reports/benchmarks.md).
    Returns (out [b, n, h, d], final_state).

    CUDA tensors go to the Triton kernel (models/lightning_triton.py) with its own block size: a
    256 x 256 score tile would spill registers there.
    """
    if q.is_cuda:
        from megacispo.models.lightning_triton import lightning_attention_triton

        return lightning_attention_triton(q, k, v, decay, initial_state, cu_seqlens)
    check_qkv(q, k, v)
    batch, seq_len, num_heads, head_dim = q.shape
    check_decay(decay, num_heads)
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    doc_lengths = document_lengths(cu_seqlens, batch, seq_len)
    packed = cu_seqlens is not None
    if initial_state is not None:
        num_states = len(doc_lengths) if packed else batch
        check_state("initial_state", initial_state, (num_states, num_heads, head_dim, head_dim))
        if initial_state.dtype != q.dtype:
            raise ValueError(f"initial_state dtype must be q's {q.dtype}, got {initial_state.dtype}")
        initial_state = _public_to_doc_states(initial_state, packed)

    layout = _BlockLayout.build(tuple(doc_lengths), block_size, max(1, CHUNK_TOKENS // block_size), q.device)
    decays = _BlockDecays.build(decay, layout, q.dtype, with_initial_state=initial_state is not None)
    out, final_states = _LightningAttentionFunction.apply(q, k, v, initial_state, decays, layout)
    return out, _doc_to_public_states(final_states, packed)


def _public_to_doc_states(state: torch.Tensor, packed: bool) -> torch.Tensor:
    """[b, h, d, d] (one document per row) or packed [D, h, d, d] -> [b, h, D, d, d]."""
    return state.transpose(0, 1).unsqueeze(0) if packed else state.unsqueeze(2)


def _doc_to_public_states(state: torch.Tensor, packed: bool) -> torch.Tensor:
    """Inverse of _public_to_doc_states."""
    return state.squeeze(0).transpose(0, 1) if packed else state.squeeze(2)


# ---------------------------------------------------------------------------------------------
# Block layout and decay factors


@dataclass(frozen=True)
class _Chunk:
    """A run of whole blocks processed together; its real tokens are one contiguous token range.

    The *_lag fields say, per block g of the chunk, which power m of exp(-s B) links two states,
    or -1 where they are unrelated (different documents): they turn the block-to-block state
    recurrence inside the chunk into a few batched ops instead of a Python loop over blocks.
    """

    first_block: int
    num_blocks: int
    token_start: int
    token_end: int
    token_slots: torch.Tensor  # [tokens] long: slot of each of the chunk's tokens in its [G * B] slots
    block_docs: torch.Tensor  # [G] long: document of each block
    within_lag: torch.Tensor  # [G, G] long: g - 1 - g' if block g' < g in the same document
    carry_in_lag: torch.Tensor  # [G] long: g if block g continues the document entering the chunk
    carry_out_lag: torch.Tensor  # [G] long: G - 1 - g if block g's document continues after the chunk
    end_lag: torch.Tensor  # [G] long: e - g if block g's document ends inside the chunk at block e
    final_blocks: torch.Tensor  # [k] long: the blocks that end a document
    final_docs: torch.Tensor  # [k] long: their documents
    dense: bool  # the chunk's tokens fill all its slots in order (no padding): moved without an index


@dataclass(frozen=True)
class _BlockLayout:
    """Where each token lives once documents are front-padded to whole blocks."""

    block_size: int
    blocks_per_chunk: int
    num_docs: int
    chunks: list[_Chunk]
    slot_positions: torch.Tensor  # [nb, B] long: position in its document (negative = padding)
    doc_lengths: torch.Tensor  # [D] long

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def build(
        doc_lengths: tuple[int, ...], block_size: int, blocks_per_chunk: int, device: torch.device
    ) -> _BlockLayout:
        """Cached: every lightning layer of a model step sees the same document lengths. Built on the
        host (Python lengths in, a few small index tensors out), then moved to ``device`` once."""
        lengths = torch.tensor(doc_lengths, dtype=torch.long, device="cpu")
        blocks_per_doc = (lengths + block_size - 1) // block_size
        first_blocks = torch.cumsum(blocks_per_doc, 0) - blocks_per_doc
        first_token_slot = (first_blocks + blocks_per_doc) * block_size - lengths  # slot of each doc's token 0
        doc_starts = torch.cumsum(lengths, 0) - lengths
        docs = torch.arange(len(doc_lengths), device="cpu")
        token_slots = torch.arange(sum(doc_lengths), device="cpu") + torch.repeat_interleave(
            first_token_slot - doc_starts, lengths
        )
        num_blocks = int(blocks_per_doc.sum())
        slot_doc = torch.repeat_interleave(docs, blocks_per_doc * block_size)
        slot_positions = torch.arange(num_blocks * block_size, device="cpu") - first_token_slot[slot_doc]
        doc_of_block = torch.repeat_interleave(docs, blocks_per_doc)
        chunks = [
            _build_chunk(first, blocks_per_chunk, token_slots, doc_of_block, block_size, device)
            for first in range(0, num_blocks, blocks_per_chunk)
        ]
        return _BlockLayout(
            block_size=block_size,
            blocks_per_chunk=blocks_per_chunk,
            num_docs=len(doc_lengths),
            chunks=chunks,
            slot_positions=slot_positions.view(num_blocks, block_size).to(device),
            doc_lengths=lengths.to(device),
        )


def _build_chunk(
    first_block: int,
    blocks_per_chunk: int,
    token_slots: torch.Tensor,
    doc_of_block: torch.Tensor,
    block_size: int,
    device: torch.device,
) -> _Chunk:
    num_blocks = min(blocks_per_chunk, len(doc_of_block) - first_block)
    slot_start, slot_end = first_block * block_size, (first_block + num_blocks) * block_size
    # token_slots is increasing, so the chunk's tokens form a contiguous range.
    slot_range = torch.tensor([slot_start, slot_end], device="cpu")
    token_start, token_end = torch.searchsorted(token_slots, slot_range).tolist()
    docs = doc_of_block[first_block : first_block + num_blocks]  # [G]
    g = torch.arange(num_blocks, device="cpu")  # host-side, as the layout it is built from
    same_doc = docs[:, None] == docs[None, :]  # [G, G]
    lag = g[:, None] - 1 - g[None, :]
    continues_before = first_block > 0 and bool(doc_of_block[first_block - 1] == docs[0])
    after = first_block + num_blocks
    continues_after = after < len(doc_of_block) and bool(doc_of_block[after] == docs[-1])
    ends_doc = torch.ones(num_blocks, dtype=torch.bool, device="cpu")
    ends_doc[:-1] = docs[1:] != docs[:-1]
    ends_doc[-1] = not continues_after
    last_in_chunk = torch.where(same_doc, g[None, :], -1).amax(dim=1)  # [G]: last block of g's document here
    final_blocks = torch.nonzero(ends_doc).flatten()

    def where(condition: torch.Tensor, lags: torch.Tensor) -> torch.Tensor:
        return torch.where(condition, lags, -1).to(device)

    return _Chunk(
        first_block=first_block,
        num_blocks=num_blocks,
        token_start=token_start,
        token_end=token_end,
        token_slots=(token_slots[token_start:token_end] - slot_start).to(device),
        block_docs=docs.to(device),
        within_lag=where(same_doc & (lag >= 0), lag),
        carry_in_lag=where((docs == docs[0]) & continues_before, g),
        carry_out_lag=where((docs == docs[-1]) & continues_after, num_blocks - 1 - g),
        end_lag=where(ends_doc[last_in_chunk], last_in_chunk - g),
        final_blocks=final_blocks.to(device),
        final_docs=docs[final_blocks].to(device),
        # token_slots increases within [0, G * B), so as many tokens as slots means slot i = token i.
        dense=token_end - token_start == slot_end - slot_start,
    )


@dataclass(frozen=True)
class _BlockDecays:
    """Powers of exp(-s_h) used block-wise; computed in fp64, stored in the compute dtype."""

    intra: torch.Tensor  # [h, 1, B, B]: exp(-s (i - j)) for i >= j, else 0
    query: torch.Tensor  # [h, 1, B, 1]: exp(-s (i + 1)), the state entering the block seen at row i
    key: torch.Tensor  # [h, 1, B, 1]: exp(-s (B - 1 - j)), key j decayed to the block's end
    block: torch.Tensor  # [h, 1, 1, 1]: exp(-s B), the state carried across one whole block
    block_powers: torch.Tensor  # [h, G + 1]: exp(-s B m) for m = 0 .. blocks_per_chunk
    # Only with an initial state:
    initial: torch.Tensor | None  # [h, nb, B, 1]: exp(-s (p + 1)) at document position p (1 on padding)
    initial_to_final: torch.Tensor | None  # [h, D, 1, 1]: exp(-s * document length)

    @staticmethod
    def build(
        decay: torch.Tensor, layout: _BlockLayout, dtype: torch.dtype, with_initial_state: bool
    ) -> _BlockDecays:
        device = layout.slot_positions.device
        rate = decay.detach().to(device=device, dtype=torch.float64)[:, None, None]  # [h, 1, 1]
        block_size = layout.block_size
        steps = torch.arange(block_size, dtype=torch.float64, device=device)
        distance = steps[:, None] - steps[None, :]  # [B, B]: i - j
        intra = torch.exp(-rate * distance.clamp(min=0)) * (distance >= 0)
        block_steps = torch.arange(layout.blocks_per_chunk + 1, dtype=torch.float64, device=device)
        initial = initial_to_final = None
        if with_initial_state:
            # Padding slots hold zero q, so their factor is irrelevant; clamping keeps it finite.
            positions = layout.slot_positions.to(torch.float64).clamp(min=-1)
            initial = torch.exp(-rate * (positions + 1)).unsqueeze(-1).to(dtype)
            lengths = layout.doc_lengths.to(torch.float64)
            initial_to_final = torch.exp(-rate * lengths[:, None]).unsqueeze(-1).to(dtype)
        return _BlockDecays(
            intra=intra.unsqueeze(1).to(dtype),
            query=torch.exp(-rate * (steps + 1)[:, None]).unsqueeze(1).to(dtype),
            key=torch.exp(-rate * (block_size - 1 - steps)[:, None]).unsqueeze(1).to(dtype),
            block=torch.exp(-rate * block_size).unsqueeze(1).to(dtype),
            block_powers=torch.exp(-rate[:, 0] * block_size * block_steps).to(dtype),
            initial=initial,
            initial_to_final=initial_to_final,
        )


def _lag_decay(decays: _BlockDecays, lag: torch.Tensor) -> torch.Tensor:
    """exp(-s B lag) where lag >= 0, 0 where lag == -1: [h, *lag.shape]."""
    return decays.block_powers[:, lag.clamp(min=0)] * (lag >= 0)


def _gather_chunk(x: torch.Tensor, chunk: _Chunk, block_size: int) -> torch.Tensor:
    """[b, n, h, d] -> the chunk's zero-padded, contiguous blocks [b, h, G, B, d]."""
    batch, _, num_heads, head_dim = x.shape
    tokens = x[:, chunk.token_start : chunk.token_end].transpose(1, 2)  # [b, h, tokens, d]
    if chunk.dense:  # one strided copy: 6x faster on a CPU than zero-filling, then index_copy_
        blocks = tokens.clone(memory_format=torch.contiguous_format)
    else:
        blocks = x.new_zeros(batch, num_heads, chunk.num_blocks * block_size, head_dim)
        blocks.index_copy_(2, chunk.token_slots, tokens)
    return blocks.view(batch, num_heads, chunk.num_blocks, block_size, head_dim)


def _scatter_chunk(out: torch.Tensor, blocks: torch.Tensor, chunk: _Chunk) -> None:
    """Write the chunk's blocks [b, h, G, B, d] into out [b, n, h, d], dropping the padding."""
    real = blocks.flatten(2, 3)  # [b, h, G * B, d]
    if not chunk.dense:
        real = real.index_select(2, chunk.token_slots)  # [b, h, tokens, d]
    out[:, chunk.token_start : chunk.token_end] = real.transpose(1, 2)


def _chunk_initial_decay(decays: _BlockDecays, chunk: _Chunk) -> torch.Tensor:
    """[h, G, B, 1] slice of decays.initial."""
    return decays.initial[:, chunk.first_block : chunk.first_block + chunk.num_blocks]


def _per_block(factor: torch.Tensor) -> torch.Tensor:
    """[h, G] -> [h, G, 1, 1], to scale [b, h, G, d, d] states block by block."""
    return factor[..., None, None]


# ---------------------------------------------------------------------------------------------
# Forward (tensors of one chunk in the [b, h, G, B, d] block layout)


def _intra_scores(q: torch.Tensor, k: torch.Tensor, decays: _BlockDecays) -> torch.Tensor:
    """Decayed causal scores inside each block: (Q K^T) * D, [b, h, G, B, B]."""
    return (q @ k.transpose(-1, -2)).mul_(decays.intra)


def _block_key_values(k: torch.Tensor, v: torch.Tensor, decays: _BlockDecays) -> torch.Tensor:
    """Each block's contribution to the state at its end: (K * k_decay)^T V, [b, h, G, d, d]."""
    return (k * decays.key).transpose(-1, -2) @ v


def _chunk_states(
    block_kv: torch.Tensor, entering: torch.Tensor, decays: _BlockDecays, chunk: _Chunk
) -> tuple[torch.Tensor, torch.Tensor]:
    """States entering and leaving each block of the chunk, both [b, h, G, d, d].

    entering [b, h, d, d] is the state entering the chunk. Unrolled recurrence:
    entering[g] = sum_{g' < g, same doc} exp(-s B (g - 1 - g')) kv[g'] + exp(-s B g) entering
    (the last term only while the document entering the chunk goes on); the state resets at
    document starts because blocks of other documents get factor 0.
    """
    within = _lag_decay(decays, chunk.within_lag)  # [h, G, G]
    carried = _per_block(_lag_decay(decays, chunk.carry_in_lag)) * entering.unsqueeze(2)
    states = (within @ block_kv.flatten(3)).view_as(block_kv) + carried
    return states, decays.block * states + block_kv


def _forward_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, states: torch.Tensor, decays: _BlockDecays
) -> torch.Tensor:
    """Left product inside each block plus right product with the state entering it."""
    return _intra_scores(q, k, decays) @ v + (q * decays.query) @ states


def _lightning_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_states: torch.Tensor | None,
    decays: _BlockDecays,
    layout: _BlockLayout,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """out [b, n, h, d], final states [b, h, D, d, d], and the state entering each chunk
    [b, h, num_chunks, d, d] (what backward needs to recompute a chunk's block states).

    initial_states: [b, h, D, d, d] or None. Plain torch ops: autograd can run through it.
    """
    batch, _, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    final_states = q.new_empty(batch, num_heads, layout.num_docs, head_dim, head_dim)
    running = q.new_zeros(batch, num_heads, head_dim, head_dim)
    chunk_entering_states = []
    for chunk in layout.chunks:
        chunk_entering_states.append(running)
        q_blocks, k_blocks, v_blocks = (_gather_chunk(x, chunk, layout.block_size) for x in (q, k, v))
        states, leaving = _chunk_states(_block_key_values(k_blocks, v_blocks, decays), running, decays, chunk)
        running = leaving[:, :, -1]
        final_states.index_copy_(2, chunk.final_docs, leaving.index_select(2, chunk.final_blocks))
        out_blocks = _forward_chunk(q_blocks, k_blocks, v_blocks, states, decays)
        if initial_states is not None:
            initial_blocks = initial_states.index_select(2, chunk.block_docs)  # [b, h, G, d, d]
            out_blocks = out_blocks + (q_blocks * _chunk_initial_decay(decays, chunk)) @ initial_blocks
        _scatter_chunk(out, out_blocks, chunk)
    if initial_states is not None:
        final_states = final_states + decays.initial_to_final * initial_states
    return out, final_states, torch.stack(chunk_entering_states, dim=2)


# ---------------------------------------------------------------------------------------------
# Backward


def _chunk_state_grads(
    grad_entering_direct: torch.Tensor,
    grad_next_entering: torch.Tensor,
    grad_final: torch.Tensor,
    decays: _BlockDecays,
    chunk: _Chunk,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient w.r.t. the state leaving each block [b, h, G, d, d] and w.r.t. the state entering
    the chunk [b, h, d, d].

    grad_entering_direct [b, h, G, d, d]: gradient w.r.t. the state entering each block through
    that block's outputs; grad_next_entering [b, h, d, d]: w.r.t. the state entering the next chunk;
    grad_final [b, h, D, d, d]. The state leaving block g feeds the later blocks of its document
    (the transposed recurrence of _chunk_states), its document's final state, or the next chunk.
    """
    within = _lag_decay(decays, chunk.within_lag)  # [h, G, G]
    grad_leaving = (within.transpose(-1, -2) @ grad_entering_direct.flatten(3)).view_as(grad_entering_direct)
    grad_leaving += _per_block(_lag_decay(decays, chunk.end_lag)) * grad_final.index_select(2, chunk.block_docs)
    grad_leaving += _per_block(_lag_decay(decays, chunk.carry_out_lag)) * grad_next_entering.unsqueeze(2)
    grad_entering_chunk = grad_entering_direct[:, :, 0] + decays.block[:, 0] * grad_leaving[:, :, 0]
    return grad_leaving, grad_entering_chunk


def _intra_grads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, decays: _BlockDecays
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of out = P V with P = (Q K^T) * D, recomputing P; all [b, h, G, B, d]."""
    scores = _intra_scores(q, k, decays)
    grad_v = scores.transpose(-1, -2) @ grad_out
    del scores
    grad_scores = (grad_out @ v.transpose(-1, -2)).mul_(decays.intra)
    return grad_scores @ k, grad_scores.transpose(-1, -2) @ q, grad_v


def _backward_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    entering: torch.Tensor,
    grad_next_entering: torch.Tensor,
    grad_final: torch.Tensor,
    decays: _BlockDecays,
    chunk: _Chunk,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """grad q, k, v of one chunk [b, h, G, B, d] and the gradient w.r.t. the state entering it."""
    states, _ = _chunk_states(_block_key_values(k, v, decays), entering, decays, chunk)
    grad_q, grad_k, grad_v = _intra_grads(q, k, v, grad_out, decays)
    # Right product: out += (Q * q_decay) S_in, and S_out = exp(-s B) S_in + (K * k_decay)^T V.
    grad_q += (grad_out @ states.transpose(-1, -2)) * decays.query
    grad_entering_direct = (q * decays.query).transpose(-1, -2) @ grad_out
    grad_leaving, grad_entering_chunk = _chunk_state_grads(
        grad_entering_direct, grad_next_entering, grad_final, decays, chunk
    )
    grad_k += (v @ grad_leaving.transpose(-1, -2)) * decays.key
    grad_v += (k * decays.key) @ grad_leaving
    return grad_q, grad_k, grad_v, grad_entering_chunk


def _lightning_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_states: torch.Tensor | None,
    chunk_entering_states: torch.Tensor,
    grad_out: torch.Tensor,
    grad_final: torch.Tensor,
    decays: _BlockDecays,
    layout: _BlockLayout,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of q, k, v ([b, n, h, d]) and initial_states ([b, h, D, d, d]), chunks in reverse."""
    grad_q, grad_k, grad_v = (torch.empty_like(x) for x in (q, k, v))
    grad_initial = None if initial_states is None else decays.initial_to_final * grad_final
    grad_next_entering = torch.zeros_like(chunk_entering_states[:, :, 0])
    for index in reversed(range(len(layout.chunks))):
        chunk = layout.chunks[index]
        blocks = [_gather_chunk(x, chunk, layout.block_size) for x in (q, k, v, grad_out)]
        *chunk_grads, grad_next_entering = _backward_chunk(
            *blocks, chunk_entering_states[:, :, index], grad_next_entering, grad_final, decays, chunk
        )
        if initial_states is not None:
            q_blocks, grad_out_blocks = blocks[0], blocks[3]
            initial_decay = _chunk_initial_decay(decays, chunk)  # [h, G, B, 1]
            initial_blocks = initial_states.index_select(2, chunk.block_docs)  # [b, h, G, d, d]
            chunk_grads[0] += (grad_out_blocks @ initial_blocks.transpose(-1, -2)) * initial_decay
            grad_initial_blocks = (q_blocks * initial_decay).transpose(-1, -2) @ grad_out_blocks
            grad_initial.index_add_(2, chunk.block_docs, grad_initial_blocks)
        for grad, chunk_grad in zip((grad_q, grad_k, grad_v), chunk_grads):
            _scatter_chunk(grad, chunk_grad, chunk)
    return grad_q, grad_k, grad_v, grad_initial


class _LightningAttentionFunction(torch.autograd.Function):
    """Saves q, k, v, initial_states and one state per chunk; backward recomputes the rest."""

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        initial_states: torch.Tensor | None,
        decays: _BlockDecays,
        layout: _BlockLayout,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, final_states, chunk_entering_states = _lightning_forward(q, k, v, initial_states, decays, layout)
        ctx.save_for_backward(q, k, v, initial_states, chunk_entering_states)
        ctx.decays, ctx.layout = decays, layout
        return out, final_states

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor, grad_final: torch.Tensor):
        q, k, v, initial_states, chunk_entering_states = ctx.saved_tensors
        grads = _lightning_backward(
            q, k, v, initial_states, chunk_entering_states, grad_out, grad_final, ctx.decays, ctx.layout
        )
        return *grads, None, None
