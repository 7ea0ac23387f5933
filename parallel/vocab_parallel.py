"""Token log-probs and entropy from vocab-sharded logits, without ever gathering the vocabulary.

Under tensor parallelism (TP) the LM head is Megatron's ColumnParallelLinear: rank r of the TP
group holds rows [r * V/TP, (r + 1) * V/TP) of the output weight and computes the logits of that
contiguous vocabulary shard only. For the target token t of each position

    logp(t) = z_t - logsumexp(z) = z_t - m - log(s),  m = max over the vocabulary, s = sum exp(z - m)
    entropy = log(s) + m - sum p * z                 (= log(s) - sum p * (z - m), computed that way)

Each rank reduces its own shard to a few numbers per token (local max, sum of exp relative to the
local max, the target logit where it owns the target, the entropy term), then two collectives over
[tokens]-sized vectors finish the job: an all-reduce MAX of the local maxima, and one all-reduce
SUM of the local sums rescaled by exp(local max - global max) (that product is the spec's
sum exp(z_local - m)), packed with the target logit (0 on the ranks that do not own it) and the
entropy term. Rescaling lets the fused head merge the statistics of its tiles of logits (chunks of
tokens x chunks of the shard's columns) and reduce those of all its tokens at once, instead of two
collectives per tile. Memory stays O(tokens x V/TP), and the fused head cuts it to O(tile).

The backward of logp w.r.t. this rank's logits is onehot_local(t) - softmax_local = onehot - exp(z
- logsumexp): it needs only the per-token logsumexp, so it communicates nothing. All the math runs
in fp32 at least (fp64 inputs stay fp64), whatever the input dtype: this is MiniMax-M1's FP32 LM
head, the fix for the mismatch between training-engine and rollout-engine probabilities.

Process groups are arguments: ``tp_group=None`` means a single process holding the whole
vocabulary (no communication); unlike torch.distributed, None never means the world group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# The fused head computes about this many bytes of fp32 logits at a time, per rank. On a CPU a tile
# that stays in the last-level cache makes the exp, the gradient and both matmuls of the backward
# run from cache (the LM head of an RL update took half the time of 64 MiB chunks of whole rows,
# benchmarks/rl_vs_hf.py); on a GPU a tile is large enough that each matmul runs at full speed.
LOGITS_TILE_BYTES = {"cpu": 2 * 2**20, "cuda": 64 * 2**20}
# Narrower tiles would turn the head's matmuls into thin ones that run below full speed.
MIN_VOCAB_CHUNK = 1024
# A call whose logits (this rank's shard) take at most this many bytes keeps them from the forward
# for the backward instead of recomputing them: one matmul of four saved where memory is no
# concern (a small model's RL update on CPU), the O(tile) memory of recomputation at scale.
LOGITS_KEEP_BYTES = 256 * 2**20


# ---------------------------------------------------------------------------------------------
# Vocabulary shards and input checks
# ---------------------------------------------------------------------------------------------


def vocab_shard_range(vocab_size: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of the token ids whose logits rank ``tp_rank`` of ``tp_size`` holds.

    Equal contiguous shards, as Megatron's VocabParallelEmbedding and ColumnParallelLinear split
    them; ValueError if the vocabulary does not divide evenly.
    """
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank = {tp_rank} with tp_size = {tp_size}: need tp_size >= 1 and 0 <= tp_rank < tp_size")
    if vocab_size % tp_size:
        raise ValueError(
            f"vocab_size = {vocab_size} is not divisible by the tensor-parallel size {tp_size}: pad the "
            f"vocabulary to a multiple of {tp_size} (Megatron's make_vocab_size_divisible_by does this)"
        )
    width = vocab_size // tp_size
    return tp_rank * width, (tp_rank + 1) * width


def _group_rank_and_size(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    if tp_group is None:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def _shard_start(shard_width: int, tp_group: dist.ProcessGroup | None, vocab_start_index: int | None) -> int:
    """The first token id of this rank's shard; checks an explicit ``vocab_start_index``."""
    tp_rank, tp_size = _group_rank_and_size(tp_group)
    if vocab_start_index is None:
        return tp_rank * shard_width
    if vocab_start_index % shard_width or not 0 <= vocab_start_index < tp_size * shard_width:
        raise ValueError(
            f"vocab_start_index = {vocab_start_index} is not the start of an equal shard of width {shard_width} "
            f"in a vocabulary of {tp_size} x {shard_width}: pass k * {shard_width} with 0 <= k < {tp_size}, "
            "or None to derive it from the rank in tp_group"
        )
    return vocab_start_index


def _check_targets(
    targets: torch.Tensor, expected_shape: torch.Size, vocab_size: int, source: str, check_range: bool
) -> None:
    """``source`` says which shape ``targets`` must follow, e.g. "logits has shape (37, 500)"."""
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise ValueError(f"targets has dtype {targets.dtype}: pass integer token ids (torch.long)")
    if targets.shape != expected_shape:
        raise ValueError(
            f"targets has shape {tuple(targets.shape)} but {source}: pass targets of shape "
            f"{tuple(expected_shape)}, one token id per position"
        )
    if not check_range or not targets.numel():
        return
    # One device-to-host sync. An id outside the vocabulary is owned by no rank, so it would
    # silently get the log-prob of a zero logit instead of failing.
    outside = (targets < 0) | (targets >= vocab_size)
    if bool(outside.any()):
        raise ValueError(
            f"targets holds token ids outside the vocabulary [0, {vocab_size}) (e.g. {targets[outside][0].item()}): "
            "replace ignored positions (-100, padding) by any valid id and drop them with the loss mask"
        )


def _local_targets(targets: torch.Tensor, shard_start: int, shard_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into this rank's shard, clamped so it is always a valid index; whether the rank owns it)."""
    local = targets - shard_start
    owned = (local >= 0) & (local < shard_width)
    return local.clamp(0, shard_width - 1), owned


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


# ---------------------------------------------------------------------------------------------
# Per-shard statistics and their reduction over the TP group
# ---------------------------------------------------------------------------------------------


@dataclass
class _ShardStats:
    """One rank's per-token summary of its vocabulary shard, all [tokens]; sums relative to ``local_max``."""

    local_max: torch.Tensor
    sum_exp: torch.Tensor
    """sum exp(z - local_max) over the shard."""
    target_logit: torch.Tensor | None
    """z_target where this rank owns the target, else 0 (so the SUM over ranks is z_target)."""
    entropy_term: torch.Tensor | None
    """sum exp(z - local_max) * (z - local_max) over the shard."""

    @staticmethod
    def cat(parts: list[_ShardStats]) -> _ShardStats:
        def cat_field(name: str) -> torch.Tensor | None:
            values = [getattr(part, name) for part in parts]
            return None if values[0] is None else torch.cat(values)

        return _ShardStats(*(cat_field(name) for name in ("local_max", "sum_exp", "target_logit", "entropy_term")))


def _shard_stats(
    logits: torch.Tensor,
    local_targets: torch.Tensor | None,
    owned: torch.Tensor | None,
    with_entropy: bool,
) -> _ShardStats:
    """Summarize [tokens, V/TP] logits (compute dtype; not modified) into per-token statistics."""
    local_max = logits.amax(dim=-1)
    target_logit = None
    if local_targets is not None:
        target_logit = torch.where(owned, logits.gather(-1, local_targets[:, None]).squeeze(-1), 0.0)
    shifted = logits - local_max[:, None]  # [tokens, V/TP], <= 0
    if not with_entropy:
        return _ShardStats(local_max, shifted.exp_().sum(dim=-1), target_logit, None)
    exp_shifted = shifted.exp()
    return _ShardStats(local_max, exp_shifted.sum(dim=-1), target_logit, torch.linalg.vecdot(exp_shifted, shifted))


@dataclass
class _TokenResults:
    """Per-token results over the whole vocabulary, [tokens] each."""

    logsumexp: torch.Tensor
    logprobs: torch.Tensor | None
    entropy: torch.Tensor | None


def _reduce_over_vocab(stats: _ShardStats, tp_group: dist.ProcessGroup | None) -> _TokenResults:
    """Combine every rank's shard statistics: all-reduce MAX, then one packed all-reduce SUM."""
    global_max = stats.local_max.clone()
    if tp_group is not None:
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
    # Moves this rank's sums from its local max to the global one: exp(z - m) = exp(z - m_local) * scale.
    offset = stats.local_max - global_max  # <= 0
    scale = offset.exp()
    rows = [stats.sum_exp * scale]
    if stats.target_logit is not None:
        rows.append(stats.target_logit)
    if stats.entropy_term is not None:
        rows.append(scale * (stats.entropy_term + stats.sum_exp * offset))
    packed = torch.stack(rows)  # [1 to 3, tokens]
    if tp_group is not None:
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)
    sum_exp, *rest = packed.unbind()
    log_sum_exp = sum_exp.log()
    logprobs = rest.pop(0) - global_max - log_sum_exp if stats.target_logit is not None else None
    entropy = log_sum_exp - rest.pop(0) / sum_exp if stats.entropy_term is not None else None
    return _TokenResults(global_max + log_sum_exp, logprobs, entropy)


def _grad_of_logits(
    logits: torch.Tensor,
    logsumexp: torch.Tensor,
    local_targets: torch.Tensor,
    owned: torch.Tensor,
    grad_logprobs: torch.Tensor,
) -> torch.Tensor:
    """d(sum grad_logprobs * logp)/d(local logits) = grad * (onehot_local(target) - softmax_local).

    logits: [tokens, V/TP] in the compute dtype, not modified; returns a new tensor of that shape.
    """
    grad = (logits - logsumexp[:, None]).exp_().mul_(-grad_logprobs[:, None])
    return grad.scatter_add_(-1, local_targets[:, None], torch.where(owned, grad_logprobs, 0.0)[:, None])


# ---------------------------------------------------------------------------------------------
# Log-probs and entropy from vocab-sharded logits
# ---------------------------------------------------------------------------------------------


class _VocabParallelLogProbs(torch.autograd.Function):
    """logits [tokens, V/TP] -> logp [tokens]; backward onehot - softmax, no communication."""

    @staticmethod
    def forward(ctx, logits, local_targets, owned, tp_group):
        compute_logits = logits.to(_compute_dtype(logits))
        stats = _shard_stats(compute_logits, local_targets, owned, with_entropy=False)
        results = _reduce_over_vocab(stats, tp_group)
        # The input logits (bf16 ones are half the size of an fp32 softmax) and the logsumexp are
        # all the backward needs: it recomputes softmax = exp(z - logsumexp) exactly as here.
        ctx.save_for_backward(logits, local_targets, owned, results.logsumexp)
        return results.logprobs

    @staticmethod
    def backward(ctx, grad_logprobs):
        logits, local_targets, owned, logsumexp = ctx.saved_tensors
        compute_logits = logits.to(logsumexp.dtype)
        grad = _grad_of_logits(compute_logits, logsumexp, local_targets, owned, grad_logprobs.to(logsumexp.dtype))
        return grad.to(logits.dtype), None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    vocab_start_index: int | None = None,
    check_targets: bool = True,
) -> torch.Tensor:
    """log p(target) of every position, from this rank's vocabulary shard of the logits.

    Args:
        logits: [..., V/TP], this rank's contiguous shard of the vocabulary, any float dtype.
        targets: [...], global token ids in [0, V); the same on every rank of ``tp_group``.
        tp_group: the tensor-parallel group the vocabulary is split over; None: one process, the
            whole vocabulary.
        vocab_start_index: the first token id of this shard; None derives it from the rank in
            ``tp_group`` (rank r holds [r * V/TP, (r + 1) * V/TP), Megatron's split).
        check_targets: raise ValueError for ids outside [0, V). Costs one device-to-host sync.

    Returns:
        [...] log-probs in fp32 (fp64 for fp64 logits), differentiable w.r.t. ``logits``.
    """
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits has shape {tuple(logits.shape)}: pass [..., V/TP] with a non-empty vocabulary shard")
    shard_width = logits.shape[-1]
    shard_start = _shard_start(shard_width, tp_group, vocab_start_index)
    vocab_size = shard_width * _group_rank_and_size(tp_group)[1]
    _check_targets(targets, logits.shape[:-1], vocab_size, f"logits has shape {tuple(logits.shape)}", check_targets)
    local_targets, owned = _local_targets(targets.reshape(-1), shard_start, shard_width)
    logprobs = _VocabParallelLogProbs.apply(logits.reshape(-1, shard_width), local_targets, owned, tp_group)
    return logprobs.view(targets.shape)


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor, tp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Entropy of the next-token distribution at every position, for logging (detached).

    logits: [..., V/TP], this rank's contiguous vocabulary shard; returns [...] in fp32 (fp64 for
    fp64 logits), the same on every rank of ``tp_group``. Logits must be finite.
    """
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits has shape {tuple(logits.shape)}: pass [..., V/TP] with a non-empty vocabulary shard")
    flat = logits.reshape(-1, logits.shape[-1]).to(_compute_dtype(logits))
    stats = _shard_stats(flat, None, None, with_entropy=True)
    return _reduce_over_vocab(stats, tp_group).entropy.view(logits.shape[:-1])


# ---------------------------------------------------------------------------------------------
# The fused, tiled LM head
# ---------------------------------------------------------------------------------------------


def default_tile(num_tokens: int, shard_width: int, device: torch.device) -> tuple[int, int]:
    """(tokens, vocabulary columns) of one tile of fp32 logits of about ``LOGITS_TILE_BYTES[device]``:
    the whole shard's width when the tokens allow, else narrower (never under MIN_VOCAB_CHUNK
    columns, so that each matmul stays wide) and fewer tokens."""
    elements = LOGITS_TILE_BYTES.get(device.type, LOGITS_TILE_BYTES["cuda"]) // 4
    vocab_chunk = min(shard_width, max(MIN_VOCAB_CHUNK, elements // max(num_tokens, 1)))
    return max(1, elements // vocab_chunk), vocab_chunk


def _chunks(length: int, size: int) -> list[slice]:
    # At least one chunk, empty for an empty batch, so that it still yields (empty) statistics.
    return [slice(start, min(start + size, length)) for start in range(0, max(length, 1), size)]


def _merge_stats(first: _ShardStats, second: _ShardStats) -> _ShardStats:
    """The statistics of two disjoint column ranges as one: sums moved to the larger maximum, as
    ``_reduce_over_vocab`` moves each rank's."""
    local_max = torch.maximum(first.local_max, second.local_max)
    offsets = [part.local_max - local_max for part in (first, second)]  # <= 0
    scales = [offset.exp() for offset in offsets]
    sum_exp = first.sum_exp * scales[0] + second.sum_exp * scales[1]
    target_logit = None if first.target_logit is None else first.target_logit + second.target_logit
    entropy_term = None
    if first.entropy_term is not None:
        entropy_term = sum(
            scale * (part.entropy_term + part.sum_exp * offset)
            for part, scale, offset in zip((first, second), scales, offsets)
        )
    return _ShardStats(local_max, sum_exp, target_logit, entropy_term)


class _FusedLMHeadLogProbs(torch.autograd.Function):
    """hidden [tokens, H] x weight [V/TP, H] -> (logp [tokens], entropy [tokens] or None).

    Logits exist one tile [token chunk, vocabulary chunk] at a time, in the forward and again
    (recomputed) in the backward, unless they all fit in LOGITS_KEEP_BYTES: the forward then keeps
    its tiles for the backward. grad_hidden is this rank's partial sum over its vocabulary shard
    and is NOT reduced here: the caller's mapping on ``hidden`` (see ``lm_head_input``) reduces it,
    exactly as ColumnParallelLinear's input mapping does. grad_weight is local (each rank owns its
    rows): each vocabulary chunk's rows are written by the first token chunk and accumulated into
    by the others.
    """

    @staticmethod
    def forward(ctx, hidden, weight, local_targets, owned, tp_group, tile, compute_entropy):
        compute_dtype = _compute_dtype(hidden, weight)
        compute_weight = weight.to(compute_dtype)  # [V/TP, H]
        logits_bytes = hidden.shape[0] * weight.shape[0] * compute_weight.element_size()
        ctx.kept_logits = [] if any(ctx.needs_input_grad[:2]) and logits_bytes <= LOGITS_KEEP_BYTES else None
        parts = []
        for rows in _chunks(hidden.shape[0], tile[0]):
            chunk_hidden = hidden[rows].to(compute_dtype)
            stats = None
            for columns in _chunks(weight.shape[0], tile[1]):
                logits = chunk_hidden @ compute_weight[columns].T  # [token chunk, vocabulary chunk]
                if ctx.kept_logits is not None:
                    ctx.kept_logits.append(logits)
                targets, in_columns = _columns_targets(local_targets[rows], owned[rows], columns)
                tile_stats = _shard_stats(logits, targets, in_columns, compute_entropy)
                stats = tile_stats if stats is None else _merge_stats(stats, tile_stats)
            parts.append(stats)
        results = _reduce_over_vocab(_ShardStats.cat(parts), tp_group)
        ctx.save_for_backward(hidden, weight, local_targets, owned, results.logsumexp)
        ctx.tile = tile
        if results.entropy is None:
            return results.logprobs, None
        ctx.mark_non_differentiable(results.entropy)
        return results.logprobs, results.entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, local_targets, owned, logsumexp = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        compute_dtype = logsumexp.dtype
        compute_weight = weight.to(compute_dtype)
        grad_logprobs = grad_logprobs.to(compute_dtype)
        grad_hidden = torch.zeros(hidden.shape, dtype=compute_dtype, device=hidden.device) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=compute_dtype, device=weight.device) if need_weight else None
        row_chunks, column_chunks = _chunks(hidden.shape[0], ctx.tile[0]), _chunks(weight.shape[0], ctx.tile[1])
        # Vocabulary chunks outermost: a chunk's rows of grad_weight stay in cache while every token
        # chunk adds to them (the head 1.2x faster on a CPU than with the forward's order).
        for column_index, columns in enumerate(column_chunks):
            chunk_weight = compute_weight[columns]  # [vocabulary chunk, H]
            for row_index, rows in enumerate(row_chunks):
                chunk_hidden = hidden[rows].to(compute_dtype)  # [token chunk, H]
                if ctx.kept_logits is None:
                    logits = chunk_hidden @ chunk_weight.T
                else:  # kept in the forward's order, token chunks outermost
                    logits = ctx.kept_logits[row_index * len(column_chunks) + column_index]
                targets, in_columns = _columns_targets(local_targets[rows], owned[rows], columns)
                grad_logits = _grad_of_logits(logits, logsumexp[rows], targets, in_columns, grad_logprobs[rows])
                if need_hidden:
                    grad_hidden[rows].addmm_(grad_logits, chunk_weight)
                if need_weight:
                    grad_weight[columns].addmm_(grad_logits.T, chunk_hidden)
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None, None, None, None, None,
        )


def _columns_targets(local_targets: torch.Tensor, owned: torch.Tensor, columns: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """(index into the chunk of columns, clamped to a valid one; whether the chunk holds the target)."""
    in_chunk_targets, in_chunk = _local_targets(local_targets, columns.start, columns.stop - columns.start)
    return in_chunk_targets, owned & in_chunk


def lm_head_input(
    hidden: torch.Tensor, tp_group: dist.ProcessGroup | None, sequence_parallel: bool = False
) -> torch.Tensor:
    """The decoder's last hidden states as the fused head's input: ColumnParallelLinear's input mapping.

    Every TP rank multiplies the same hidden states by its own vocabulary shard, so the gradient of
    the hidden states is the SUM over ranks of each rank's partial. ``lm_head_logprobs`` returns
    that partial; this mapping's backward does the sum, once:

    - without sequence parallelism, hidden [tokens, ..., H] is already whole on every rank:
      Megatron's copy_to_tensor_model_parallel_region (forward identity, backward all-reduce);
    - with sequence parallelism, hidden [tokens / TP, ..., H] is this rank's slice of the sequence:
      gather_from_sequence_parallel_region (forward all-gather along the first dimension, backward
      reduce-scatter, which both sums the partials and hands each rank its own slice back).

    Adding an all-reduce inside the head as well would multiply the gradient by TP. Megatron's
    mappings allocate via torch.cuda: on a CPU-only torch, start with ``layout.init_distributed``
    (it applies the CPU back-end) before using this.
    """
    if tp_group is None:
        if sequence_parallel:
            raise ValueError("sequence_parallel = True needs a tp_group (sequence parallelism splits over TP ranks)")
        return hidden
    # Imported here: megatron.core takes seconds to import, and nothing else in this module needs it.
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    if sequence_parallel:
        return gather_from_sequence_parallel_region(hidden, group=tp_group)
    return copy_to_tensor_model_parallel_region(hidden, group=tp_group)


def lm_head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
    compute_entropy: bool = False,
    check_targets: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of the targets through the FP32 LM head, never holding all logits.

    Equals ``vocab_parallel_logprobs(lm_head_input(hidden) @ weight.T, targets)`` (mcore's
    ColumnParallelLinear without bias) in value and gradient, with the logits computed one tile of
    ``chunk_size`` tokens x ``vocab_chunk_size`` vocabulary columns at a time and recomputed in the
    backward: peak memory O(tile) instead of O(tokens x V/TP), for one extra logits matmul (unless
    this call's logits fit in LOGITS_KEEP_BYTES: then the forward keeps them for the backward).

    Args:
        hidden: [tokens, ..., H], the whole sequence on every TP rank, as returned by
            ``lm_head_input`` (which makes the backward sum grad_hidden over the TP group; this
            function itself never communicates for grad_hidden). Cast to fp32 inside.
        weight: [V/TP, H], this rank's rows of the output layer (Megatron's vocabulary split).
        targets: [tokens, ...], global token ids in [0, V), the same on every TP rank.
        tp_group: the tensor-parallel group; None: one process, the whole vocabulary.
        chunk_size: tokens per tile; None: from ``default_tile`` (about LOGITS_TILE_BYTES of fp32
            logits for the device).
        vocab_chunk_size: vocabulary columns per tile; None: from ``default_tile``.
        compute_entropy: also return the per-token entropy (detached, for logging).
        check_targets: raise ValueError for ids outside [0, V). Costs one device-to-host sync.

    Returns:
        (logprobs [tokens, ...], entropy [tokens, ...] or None), fp32 (fp64 for fp64 inputs).
    """
    if weight.dim() != 2 or weight.shape[0] == 0:
        raise ValueError(f"weight has shape {tuple(weight.shape)}: pass this rank's LM-head shard [V/TP, H]")
    if hidden.dim() < 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden has shape {tuple(hidden.shape)} but weight has shape {tuple(weight.shape)}: pass hidden "
            f"[tokens, ..., H] with H = {weight.shape[1]}, the weight's second dimension"
        )
    for name, size in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if size is not None and size < 1:
            raise ValueError(f"{name} = {size}: pass a positive number, or None for the default")
    shard_width = weight.shape[0]
    vocab_size = shard_width * _group_rank_and_size(tp_group)[1]
    _check_targets(targets, hidden.shape[:-1], vocab_size, f"hidden has shape {tuple(hidden.shape)}", check_targets)
    local_targets, owned = _local_targets(
        targets.reshape(-1), _shard_start(shard_width, tp_group, None), shard_width
    )
    default_tokens, default_columns = default_tile(local_targets.numel(), shard_width, weight.device)
    tile = (chunk_size or default_tokens, vocab_chunk_size or default_columns)
    logprobs, entropy = _FusedLMHeadLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, local_targets, owned, tp_group, tile, compute_entropy
    )
    return logprobs.view(targets.shape), None if entropy is None else entropy.view(targets.shape)
