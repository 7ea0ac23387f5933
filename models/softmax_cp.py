"""Context parallelism (CP) for the softmax-attention layers, and the document masks it shares with
packed attention on one rank (models.softmax_attention).

A packed row of N tokens (N a multiple of 2 * CP) is cut into 2 * CP equal chunks; CP rank i holds
chunk i and chunk 2 * CP - 1 - i, concatenated (``megacispo.parallel.context.zigzag_positions``),
so that every rank has the same share of the causal work, as Megatron-Core's CP does. This rank's
queries attend to their own document's keys up to their GLOBAL positions (documents may cross chunk
and rank boundaries). Two schemes (parallel.context_parallel_comm, Megatron-Core's names):

- ``attention_cp`` (all_gather, the Llama 3 scheme): K and V all-gathered over the CP group in one
  collective, dK and dV reduce-scattered back to the ranks that own those tokens;
- ``attention_cp_ring`` (p2p): K and V passed round a ring of the CP ranks, one rank's block at a
  time, and again with their gradients in the backward; no rank holds the whole row's.

Both split the work into pieces (``ring_pieces``): a query chunk against a key chunk of the same
document that lies wholly before it (no mask) or is itself (causal, a square). Each piece runs a
fused attention kernel that also returns its log-sum-exp (flash attention: CUDA's, or the CPU's;
CUDA's memory-efficient kernel for fp32), and a query's pieces are merged by their log-sum-exps.
So a rank computes its own queries only (the attention work divides by CP), no mask exists on any
device, and memory is linear in N: K and V of the row (all_gather) or of this rank (p2p), the
output and the log-sum-exp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region


def document_causal_mask(
    query_positions: torch.Tensor,
    query_documents: torch.Tensor,
    key_positions: torch.Tensor,
    key_documents: torch.Tensor,
) -> torch.Tensor:
    """[b, 1, s, T] bool, True where a query may see a key: the same document, at or before the
    query's position. Queries [b, s] (or [s]), keys [b, T] (or [T]). Every query sees itself, so no
    row is empty."""
    query_positions, query_documents = torch.atleast_2d(query_positions), torch.atleast_2d(query_documents)
    key_positions, key_documents = torch.atleast_2d(key_positions), torch.atleast_2d(key_documents)
    same_document = query_documents[:, :, None] == key_documents[:, None, :]
    causal = key_positions[:, None, :] <= query_positions[:, :, None]
    return (same_document & causal)[:, None]


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA of q [b, heads, s, d] over k, v [b, kv heads, T, d] under a bool mask [b, 1, s, T].

    On CUDA, K and V are repeated to all heads first: SDPA's memory-efficient kernel takes a mask
    but not enable_gqa, and would otherwise fall back to the math kernel, which materializes the
    [b, heads, s, T] scores; the repeat costs [b, heads, T, d] each, linear in T."""
    groups = q.shape[1] // k.shape[1]
    if q.is_cuda and groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


Piece = tuple[slice, slice, bool]
"""(query positions, key positions, causal) of one piece of a CP rank's attention."""


def attention_cp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cp_group: dist.ProcessGroup,
    scale: float,
) -> torch.Tensor:
    """Causal per-document attention of this CP rank's tokens of one packed row -> [1, heads, s, d].

    q [1, heads, s, d], k and v [1, kv heads, s, d]: this rank's zigzag tokens (``zigzag_positions``:
    chunk r, then chunk 2 CP - 1 - r) of a row of N = s CP tokens whose documents end at
    cu_seqlens[1:] (the whole row's offsets, the same on every rank). K and V travel in one all-gather
    (their gradients in one reduce-scatter), in rank order: rank r's block, its two chunks, at r s.
    """
    offsets = _check_row(q, k, v, cu_seqlens, cp_group)
    cp_size, cp_rank, dim, local = cp_group.size(), cp_group.rank(), k.shape[-1], q.shape[2]
    # [1, kv, s, 2d] -> [s, 1, kv, 2d]: Megatron's sequence gather works along dim 0, and its backward
    # reduce-scatters there, summing every rank's dK, dV of this rank's tokens.
    kv = torch.cat([k, v], dim=-1).permute(2, 0, 1, 3).contiguous()
    kv = gather_from_sequence_parallel_region(kv, tensor_parallel_output_grad=True, group=cp_group)
    kv = kv.permute(1, 2, 0, 3)  # [1, kv, N, 2d], rank after rank
    pieces = [(queries, _shifted(keys, source * local), causal)
              for source in range(cp_size)
              for queries, keys, causal in ring_pieces(offsets, local // 2, cp_size, cp_rank, source)]
    return _PieceAttention.apply(q, kv[..., :dim], kv[..., dim:], pieces, scale)


def attention_cp_ring(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cp_group: dist.ProcessGroup,
    scale: float,
) -> torch.Tensor:
    """``attention_cp`` as a ring: K and V travel rank to rank in CP - 1 steps, each rank holding one
    other rank's block at a time (two of them while the next one arrives, sent while this one is
    used), and its queries' pieces are merged by their log-sum-exps. Memory per rank is its own K
    and V and one block in flight: nothing of the whole row is gathered or saved. The backward
    passes each block round the ring again with its gradients, which reach the block's rank after
    the last step. The same shapes and offsets as ``attention_cp``."""
    offsets = _check_row(q, k, v, cu_seqlens, cp_group)
    return _RingAttention.apply(q, k, v, offsets, cp_group, scale)


def _check_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
               cp_group: dist.ProcessGroup) -> list[int]:
    """The row's document offsets, on the host (the pieces are decided there), once the shapes are checked."""
    lengths = {q.shape[2], k.shape[2], v.shape[2]}
    if len(lengths) != 1 or q.shape[0] != 1:
        raise ValueError(
            f"CP attention takes this rank's tokens of one packed row, q [1, heads, s, d] and k, v [1, kv heads, "
            f"s, d], got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    offsets = cu_seqlens.tolist()
    row_len = q.shape[2] * cp_group.size()
    if offsets[0] != 0 or offsets[-1] != row_len:
        raise ValueError(
            f"cu_seqlens spans [{offsets[0]}, {offsets[-1]}] but the row has {row_len} tokens ({q.shape[2]} on each "
            f"of {cp_group.size()} CP ranks): pass the whole row's document offsets"
        )
    return offsets


def _shifted(positions: slice, offset: int) -> slice:
    return slice(positions.start + offset, positions.stop + offset)


def ring_pieces(offsets: list[int], chunk: int, cp_size: int, rank: int, source: int) -> list[Piece]:
    """What this rank's queries attend to in the K / V block of rank ``source``: (query positions,
    key positions, causal), local indices into this rank's [2 chunk] tokens and the block's. A
    query chunk sees a key chunk of its own document that lies before it whole (causal: false) or
    is itself (causal, a square: the same positions); a key chunk after it, nothing."""
    mine, theirs = (rank, 2 * cp_size - 1 - rank), (source, 2 * cp_size - 1 - source)
    pieces = []
    for query_slot, query_chunk in enumerate(mine):
        for key_slot, key_chunk in enumerate(theirs):
            if key_chunk > query_chunk:
                continue
            for doc_start, doc_end in zip(offsets[:-1], offsets[1:]):
                q_start, q_end = max(doc_start, query_chunk * chunk), min(doc_end, (query_chunk + 1) * chunk)
                k_start, k_end = max(doc_start, key_chunk * chunk), min(doc_end, (key_chunk + 1) * chunk)
                if q_start >= q_end or k_start >= k_end:
                    continue
                queries = slice(query_slot * chunk + q_start - query_chunk * chunk,
                                query_slot * chunk + q_end - query_chunk * chunk)
                keys = slice(key_slot * chunk + k_start - key_chunk * chunk,
                             key_slot * chunk + k_end - key_chunk * chunk)
                pieces.append((queries, keys, key_chunk == query_chunk))
    return pieces


# ------------------------------------------------------------------------------------------------
# Pieces: fused kernels that return the log-sum-exp, merged by it


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Fused attention of q [1, h, n, d] over k, v [1, h, m, d] (causal: n = m, upper-left) -> (out in q's
    dtype, its log-sum-exp [1, h, n] (fp32, fp64 for fp64), what the backward needs besides): the
    CPU's flash kernel, CUDA's flash kernel (fp16 / bf16) or its memory-efficient one (fp32)."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse, ()
    # CUDA (the meta device runs its shape functions: tests/unit/test_ring_kernels.py).
    if q.dtype in (torch.float16, torch.bfloat16):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, ("flash", cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale)
    # Its log-sum-exp is padded to a multiple of 32 queries.
    return out, lse[..., :q.shape[2]], ("efficient", seed, offset, lse.shape[-1])


def _block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, scale: float, extra: tuple
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``_block_forward``'s attention, given the FINAL out and log-sum-exp of these
    queries (over all their pieces): the piece's share of dq, and its dk, dv (the kernels' D =
    rowsum(dout * out) and P = exp(s - lse) are then those of the whole attention)."""
    dout, q, k, v, out = (x.contiguous() for x in (dout, q, k, v, out))
    if q.device.type == "cpu":
        lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32).contiguous()
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    lse = lse.float()
    if extra[0] == "flash":
        _, cum_q, cum_k, max_q, max_k, seed, offset = extra
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    _, seed, offset, padded = extra
    lse = F.pad(lse, (0, padded - lse.shape[-1])).contiguous()
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


def _repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of ``_repeat_heads`` for gradients: [1, kv * g, m, d] -> [1, kv, m, d]."""
    return x if groups == 1 else x.unflatten(1, (-1, groups)).sum(2)


class _Accumulator:
    """A rank's queries' attention over their pieces so far: out and log-sum-exp, in fp32 (fp64 for fp64)."""

    def __init__(self, q: torch.Tensor):
        self.wide = torch.promote_types(q.dtype, torch.float32)
        self.out = torch.zeros(q.shape, dtype=self.wide, device=q.device)
        self.lse = torch.full(q.shape[:3], float("-inf"), dtype=self.wide, device=q.device)

    def add_pieces(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pieces: list[Piece], scale: float
                   ) -> list[tuple]:
        """Each piece's attention merged in by log-sum-exp (out = sum_b exp(lse_b - lse) out_b); keys and
        values with the KV heads ([1, kv, m, d]). Returns what each piece's backward needs."""
        groups, extras = q.shape[1] // keys.shape[1], []
        for queries, key_positions, causal in pieces:
            piece_out, piece_lse, extra = _block_forward(
                q[:, :, queries], _repeat_heads(keys[:, :, key_positions], groups),
                _repeat_heads(values[:, :, key_positions], groups), causal, scale)
            extras.append(extra)
            piece_lse = piece_lse.to(self.wide)
            merged = torch.logaddexp(self.lse[:, :, queries], piece_lse)
            self.out[:, :, queries] = (self.out[:, :, queries] * torch.exp(self.lse[:, :, queries] - merged)[..., None]
                                       + piece_out.to(self.wide) * torch.exp(piece_lse - merged)[..., None])
            self.lse[:, :, queries] = merged
        return extras


def _pieces_backward(dout: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor, pieces: list[Piece], extras, scale: float,
                     dq: torch.Tensor, dkv: torch.Tensor) -> None:
    """Add the pieces' gradients: of the queries into dq [1, h, s, d], of the keys and values into dkv
    [1, kv, m, 2d] (keys, then values, along the last dimension)."""
    groups, dim = q.shape[1] // keys.shape[1], keys.shape[-1]
    for (queries, key_positions, causal), extra in zip(pieces, extras):
        dq_piece, dk_piece, dv_piece = _block_backward(
            dout[:, :, queries], q[:, :, queries], _repeat_heads(keys[:, :, key_positions], groups),
            _repeat_heads(values[:, :, key_positions], groups), out[:, :, queries], lse[:, :, queries], causal,
            scale, extra)
        dq[:, :, queries] += dq_piece
        dkv[:, :, key_positions, :dim] += _sum_heads(dk_piece, groups)
        dkv[:, :, key_positions, dim:] += _sum_heads(dv_piece, groups)


class _PieceAttention(torch.autograd.Function):
    """Attention of q [1, h, s, d] over keys, values [1, kv, m, d] by ``pieces`` (all_gather's)."""

    @staticmethod
    def forward(ctx, q, keys, values, pieces, scale):
        accumulator = _Accumulator(q)
        extras = accumulator.add_pieces(q, keys, values, pieces, scale)
        out = accumulator.out.to(q.dtype)
        ctx.save_for_backward(q, keys, values, out, accumulator.lse)
        ctx.pieces, ctx.extras, ctx.scale = pieces, extras, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, keys, values, out, lse = ctx.saved_tensors
        wide = lse.dtype
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        dkv = torch.zeros((*keys.shape[:3], 2 * keys.shape[3]), dtype=wide, device=q.device)
        _pieces_backward(dout.contiguous(), q, keys, values, out, lse, ctx.pieces, ctx.extras, ctx.scale, dq, dkv)
        dim = keys.shape[-1]
        return dq.to(q.dtype), dkv[..., :dim].to(keys.dtype), dkv[..., dim:].to(values.dtype), None, None


# ------------------------------------------------------------------------------------------------
# The ring


class _Ring:
    """Sends this rank's block on to the next rank of the CP group and receives the previous rank's, in
    the background (``start``, then ``wait``)."""

    def __init__(self, group: dist.ProcessGroup):
        size, rank = group.size(), group.rank()
        self.group = group
        self.next_rank = dist.get_global_rank(group, (rank + 1) % size)
        self.previous_rank = dist.get_global_rank(group, (rank - 1) % size)
        self._requests: list = []

    def start(self, send: torch.Tensor) -> torch.Tensor:
        send = send.contiguous()
        received = torch.empty_like(send)
        self._requests = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, send, self.next_rank, self.group),
            dist.P2POp(dist.irecv, received, self.previous_rank, self.group),
        ])
        return received

    def wait(self) -> None:
        for request in self._requests:
            request.wait()
        self._requests = []


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, group, scale):
        size, rank, chunk, dim = group.size(), group.rank(), q.shape[2] // 2, k.shape[-1]
        accumulator, ring, block, extras = _Accumulator(q), _Ring(group), torch.cat([k, v], dim=-1), []
        for step in range(size):
            incoming = ring.start(block) if step + 1 < size else None
            pieces = ring_pieces(offsets, chunk, size, rank, (rank - step) % size)
            extras.append(accumulator.add_pieces(q, block[..., :dim], block[..., dim:], pieces, scale))
            if incoming is not None:
                ring.wait()
                block = incoming
        out = accumulator.out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, accumulator.lse)
        ctx.offsets, ctx.group, ctx.scale, ctx.extras = offsets, group, scale, extras
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, offsets, scale = ctx.group, ctx.offsets, ctx.scale
        size, rank, chunk, dim = group.size(), group.rank(), q.shape[2] // 2, k.shape[-1]
        wide = lse.dtype
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        dout, ring = dout.contiguous(), _Ring(group)
        # A block travels with the gradients of its keys and values gathered so far.
        block = torch.cat([k, v], dim=-1)
        block_grads = torch.zeros(block.shape, dtype=wide, device=q.device)
        for step in range(size):
            pieces = ring_pieces(offsets, chunk, size, rank, (rank - step) % size)
            _pieces_backward(dout, q, block[..., :dim], block[..., dim:], out, lse, pieces, ctx.extras[step], scale,
                             dq, block_grads)
            if step + 1 < size:
                incoming = ring.start(torch.cat([block.to(wide), block_grads], dim=-1))
                ring.wait()
                block, block_grads = incoming[..., :2 * dim].to(q.dtype), incoming[..., 2 * dim:]
        # The block held now is the next rank's, with every rank's gradients: one more step takes them home.
        own_grads = ring.start(block_grads)
        ring.wait()
        return dq.to(q.dtype), own_grads[..., :dim].to(k.dtype), own_grads[..., dim:].to(v.dtype), None, None, None
