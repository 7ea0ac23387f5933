"""Context parallelism (CP) for the softmax-attention layers, the Llama 3 scheme, and the document
masks it shares with packed attention on one rank (models.softmax_attention).

A packed row of N tokens (N a multiple of 2 * CP) is cut into 2 * CP equal chunks; CP rank i holds
chunk i and chunk 2 * CP - 1 - i, concatenated (``megacispo.parallel.context.zigzag_positions``),
so that every rank has the same share of the causal work, as Megatron-Core's CP does.
``attention_cp`` all-gathers K and V over the CP group, lets this rank's queries attend to their own
document's keys up to their GLOBAL positions (documents may cross chunk and rank boundaries), and in
the backward reduce-scatters dK and dV to the ranks that own those tokens.

Memory per rank: K and V of the whole row ([1, kv heads, N, d] each) and what SDPA's causal kernel
saves for the pieces' queries, linear in N: no [N / CP, N] mask exists (on CUDA; a CPU materializes
each piece's [p, prefix] mask, which is where tests run).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from torch.nn.attention.bias import causal_lower_right

from megacispo.parallel.context import zigzag_positions


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
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=groups > 1)


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
    (their gradients in one reduce-scatter). Each piece of a document in a local chunk attends to its
    document's keys up to the piece's end, causal aligned to the lower right (torch's ``CausalBias``:
    flash attention's own causal alignment on CUDA, so no [s, N] mask is built or saved there). Memory
    stays linear in N, and a piece's work is its own queries' (p x prefix): CP divides the attention
    work as it divides the tokens.
    """
    lengths = {q.shape[2], k.shape[2], v.shape[2]}
    if len(lengths) != 1 or q.shape[0] != 1:
        raise ValueError(
            f"attention_cp takes this rank's tokens of one packed row, q [1, heads, s, d] and k, v [1, kv heads, "
            f"s, d], got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    head_dim, local = k.shape[-1], q.shape[2]
    row_len = local * cp_size
    # [1, kv, s, 2d] -> [s, 1, kv, 2d]: Megatron's sequence gather works along dim 0, and its backward
    # reduce-scatters there, summing every rank's dK, dV of this rank's tokens.
    kv = torch.cat([k, v], dim=-1).permute(2, 0, 1, 3).contiguous()
    kv = gather_from_sequence_parallel_region(kv, tensor_parallel_output_grad=True, group=cp_group)
    gathered_positions = torch.cat([zigzag_positions(row_len, cp_size, rank) for rank in range(cp_size)])
    kv = kv[torch.argsort(gathered_positions).to(kv.device)].permute(1, 2, 0, 3)  # [1, kv, N, 2d], row order
    keys, values = kv[..., :head_dim], kv[..., head_dim:]
    offsets = cu_seqlens.tolist()  # the pieces are decided on the host
    if offsets[0] != 0 or offsets[-1] != row_len:
        raise ValueError(
            f"cu_seqlens spans [{offsets[0]}, {offsets[-1]}] but the row has {row_len} tokens ({local} on each of "
            f"{cp_size} CP ranks): pass the whole row's document offsets"
        )
    chunk = local // 2
    pieces = []
    for slot, chunk_index in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
        start, end = chunk_index * chunk, (chunk_index + 1) * chunk
        for doc_start, doc_end in zip(offsets[:-1], offsets[1:]):
            piece_start, piece_end = max(doc_start, start), min(doc_end, end)
            if piece_start >= piece_end:
                continue
            queries = q[:, :, slot * chunk + piece_start - start: slot * chunk + piece_end - start]
            # The piece's queries are the last of its document's prefix: causal aligned to the lower right.
            causal = causal_lower_right(piece_end - piece_start, piece_end - doc_start)
            pieces.append(F.scaled_dot_product_attention(
                queries, keys[:, :, doc_start:piece_end], values[:, :, doc_start:piece_end], attn_mask=causal,
                scale=scale, enable_gqa=q.shape[1] != k.shape[1],
            ))
    return torch.cat(pieces, dim=2)


# ------------------------------------------------------------------------------------------------
# The ring (parallel.context_parallel_comm = p2p)


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
    used), and its queries' partial attentions are merged by their log-sum-exps. Memory per rank is
    its own K and V and one block in flight: nothing of the whole row is gathered or saved. The
    backward passes each block round the ring again with its gradients, which reach the block's rank
    after the last step. The same shapes and offsets as ``attention_cp``."""
    _check_row(q, k, v)
    offsets = cu_seqlens.tolist()  # the pieces are decided on the host
    row_len = q.shape[2] * cp_group.size()
    if offsets[0] != 0 or offsets[-1] != row_len:
        raise ValueError(
            f"cu_seqlens spans [{offsets[0]}, {offsets[-1]}] but the row has {row_len} tokens ({q.shape[2]} on each "
            f"of {cp_group.size()} CP ranks): pass the whole row's document offsets"
        )
    return _RingAttention.apply(q, k, v, offsets, cp_group, scale)


def _check_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    lengths = {q.shape[2], k.shape[2], v.shape[2]}
    if len(lengths) != 1 or q.shape[0] != 1:
        raise ValueError(
            f"CP attention takes this rank's tokens of one packed row, q [1, heads, s, d] and k, v [1, kv heads, "
            f"s, d], got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )


def ring_pieces(offsets: list[int], chunk: int, cp_size: int, rank: int, source: int
                ) -> list[tuple[slice, slice, bool]]:
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


def _block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Fused attention of q [1, h, n, d] over k, v [1, h, m, d] (causal: n = m, upper-left) -> (out in q's
    dtype, its log-sum-exp [1, h, n] (fp32, fp64 for fp64), what the backward needs besides): CUDA's
    flash kernel (fp16 / bf16), or the CPU's."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if q.device.type != "cpu":  # CUDA (the meta device runs its shape functions: tests/unit)
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, ()


def _block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, scale: float, extra: tuple
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``_block_forward``'s attention, given the FINAL out and log-sum-exp of these
    queries (over every block): each block's share of dq, and its dk, dv (the flash backward's D =
    rowsum(dout * out) and P = exp(s - lse) are then those of the whole attention)."""
    dout, q, k, v, out, lse = (x.contiguous() for x in (dout, q, k, v, out, lse))
    if q.device.type != "cpu":
        cum_q, cum_k, max_q, max_k, seed, offset = extra
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


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


def _repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of ``_repeat_heads`` for gradients: [1, kv * g, m, d] -> [1, kv, m, d]."""
    return x if groups == 1 else x.unflatten(1, (-1, groups)).sum(2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, offsets, group, scale):
        size, rank, chunk = group.size(), group.rank(), q.shape[2] // 2
        groups, dim = q.shape[1] // k.shape[1], k.shape[-1]
        wide = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape, dtype=wide, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=wide, device=q.device)
        ring, block, extras = _Ring(group), torch.cat([k, v], dim=-1), []
        for step in range(size):
            incoming = ring.start(block) if step + 1 < size else None
            keys, values = _repeat_heads(block[..., :dim], groups), _repeat_heads(block[..., dim:], groups)
            for queries, key_positions, causal in ring_pieces(offsets, chunk, size, rank, (rank - step) % size):
                piece_out, piece_lse, extra = _block_forward(
                    q[:, :, queries], keys[:, :, key_positions], values[:, :, key_positions], causal, scale)
                extras.append(extra)
                # Merged by log-sum-exp: out = sum_b exp(lse_b - lse) out_b.
                merged = torch.logaddexp(lse[:, :, queries], piece_lse.to(wide))
                out[:, :, queries] = (out[:, :, queries] * torch.exp(lse[:, :, queries] - merged)[..., None]
                                      + piece_out.to(wide) * torch.exp(piece_lse.to(wide) - merged)[..., None])
                lse[:, :, queries] = merged
            if incoming is not None:
                ring.wait()
                block = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.offsets, ctx.group, ctx.scale, ctx.extras = offsets, group, scale, extras
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, offsets, scale = ctx.group, ctx.offsets, ctx.scale
        size, rank, chunk = group.size(), group.rank(), q.shape[2] // 2
        groups, dim = q.shape[1] // k.shape[1], k.shape[-1]
        wide = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        dout = dout.contiguous()
        ring, extras = _Ring(group), iter(ctx.extras)
        # A block travels with the gradients of its keys and values gathered so far.
        block = torch.cat([k, v], dim=-1)
        block_grads = torch.zeros(block.shape, dtype=wide, device=q.device)
        for step in range(size):
            keys, values = _repeat_heads(block[..., :dim], groups), _repeat_heads(block[..., dim:], groups)
            for queries, key_positions, causal in ring_pieces(offsets, chunk, size, rank, (rank - step) % size):
                dq_piece, dk_piece, dv_piece = _block_backward(
                    dout[:, :, queries], q[:, :, queries], keys[:, :, key_positions], values[:, :, key_positions],
                    out[:, :, queries], lse[:, :, queries].to(_lse_dtype(q)), causal, scale, next(extras))
                dq[:, :, queries] += dq_piece
                block_grads[:, :, key_positions, :dim] += _sum_heads(dk_piece, groups)
                block_grads[:, :, key_positions, dim:] += _sum_heads(dv_piece, groups)
            if step + 1 < size:
                incoming = ring.start(torch.cat([block.to(wide), block_grads], dim=-1))
                ring.wait()
                block, block_grads = incoming[..., :2 * dim].to(q.dtype), incoming[..., 2 * dim:]
        # The block held now is the next rank's, with every rank's gradients: one more step takes them home.
        own_grads = ring.start(block_grads)
        ring.wait()
        return dq.to(q.dtype), own_grads[..., :dim].to(k.dtype), own_grads[..., dim:].to(v.dtype), None, None, None


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    """The log-sum-exp's dtype the flash kernels take back: fp32, or fp64 on the CPU for fp64."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32
