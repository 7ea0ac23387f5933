"""Packed micro-batches: a pass's sequences laid end to end in rows of a token budget.

Right-padding every sequence of a step to its longest one makes most positions padding when the
lengths are long-tailed (an RL step's responses vary by orders of magnitude). Packing puts several
sequences into one row [1, W] with their boundaries (``cu_seqlens``, flash attention's varlen layout), so
the forward and backward run over real tokens only. It is exact: the lightning state resets at each
boundary, softmax attention is causal within each sequence, RoPE positions restart per sequence
(HybridModel.forward's packed_seq_params), and every per-token quantity of a packed row is that
of its sequence in the padded layout, gathered.

Binning. The sequences of a pass are binned into micro-batches of at most ``budget`` tokens:
longest first, each to the least-loaded bin (LPT), so the bins of a rank carry about equal work.
The data-parallel ranks agree on the number of bins (the largest any rank needs): expert
parallelism's all-to-all runs once per micro-batch on every rank of its group, so every rank runs
the same number. Deterministic: the same lengths give the same bins on any machine.

A pass's rows share one width W (its fullest bin, rounded up to ``multiple``): Megatron's pipeline
schedule sends one [W, 1, H] shape between stages for every micro-batch of a pass.

Under context parallelism each CP rank holds its zigzag share of every row (megacispo.parallel.context):
``PackedRow.pack`` gathers that rank's positions only, and ``unpack`` writes them back; the CP ranks'
writes together cover the row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from megacispo.models.softmax_attention import PackedRowParams
from megacispo.parallel.context import zigzag_positions
from megacispo.parallel.layout import ParallelConfig
from megacispo.rl.losses import Sequences

# Transformer Engine's FP8 GEMMs take [tokens, features] with tokens a multiple of 8 and features a
# multiple of 16 (its Linear's check before an FP8 product); rows give each rank's GEMMs a multiple of 16.
FP8_TOKEN_MULTIPLE = 16


def row_length_multiple(parallel: ParallelConfig, fp8: bool) -> int:
    """What every row's length is a multiple of (padding is masked out of every loss): context
    parallelism splits each row into 2 x CP chunks, sequence parallelism each rank's share of it over
    the TP ranks, and under FP8 each CP rank's share (the tokens of its GEMMs, gathered over TP) is a
    multiple of FP8_TOKEN_MULTIPLE."""
    tensor_parallel = parallel.tensor_model_parallel_size if parallel.sequence_parallel else 1
    chunks = 2 * parallel.context_parallel_size if parallel.context_parallel_size > 1 else 1
    multiple = tensor_parallel * chunks
    if fp8:
        multiple = math.lcm(multiple, FP8_TOKEN_MULTIPLE * parallel.context_parallel_size)
    return multiple


@dataclass(frozen=True)
class PackedRow:
    """Where the sequences of one micro-batch lie in its packed row of W positions, and which w of them
    this rank holds (all of them, w = W, without context parallelism)."""

    rows: tuple[int, ...]
    """The batch's rows (sequences) in this row, in order."""
    gather: torch.Tensor
    """[w] int64: each of this rank's positions' index into the batch's flattened [n * S] positions; n * S
    at padding."""
    sequence_ids: torch.Tensor
    """[1, w] int64: each of this rank's positions' sequence in the row, 0..num_sequences - 1 (the padding
    after the last sequence is one more)."""
    num_sequences: int
    """Sequences in the row, the trailing padding counted as one."""
    packed_seq_params: PackedRowParams
    """The row's boundaries for the model: cu_seqlens over every position, the padding included, on the host,
    with its copy on the device (made here, once per row: no layer copies them), and the longest document."""
    batch_width: int
    """S: the width of the batch the row gathers from."""

    width: int
    """W: the row's positions, on all CP ranks together."""

    @property
    def sequences(self) -> Sequences:
        """Which sequence each of this rank's positions belongs to, for the loss."""
        return Sequences(self.sequence_ids, self.num_sequences)

    def pack(self, values: torch.Tensor, fill: float | int | bool = 0) -> torch.Tensor:
        """[n, S', ...] per-position values of the batch (S' <= S: positions past S' are ``fill``) ->
        [1, w, ...] at this rank's positions, ``fill`` at the padding."""
        num_rows, width = values.shape[:2]
        flat = values.reshape(num_rows * width, *values.shape[2:])
        fill_cell = flat.new_full((1, *values.shape[2:]), fill)
        source = torch.cat([flat, fill_cell])
        return source[self._gather_for(num_rows, width)][None]

    def unpack(self, values: torch.Tensor, out: torch.Tensor) -> None:
        """Write this rank's [1, w] values of the row into ``out``, the batch's [n, S'] values, at their
        sequences' positions (those past S' are dropped)."""
        num_rows, width = out.shape
        index = self._gather_for(num_rows, width)
        flat = torch.cat([out.reshape(-1), out.new_zeros(1)])  # the last cell takes the padding
        flat.index_copy_(0, index, values[0].to(out.dtype))
        out.copy_(flat[:-1].view(num_rows, width))

    def _gather_for(self, num_rows: int, width: int) -> torch.Tensor:
        """``gather`` for a batch tensor [num_rows, width] (width <= S): position p of row r is r * width
        + p there; positions at or past ``width`` (a [n, S - 1] tensor's last one) read the fill cell."""
        row, position = self.gather // self.batch_width, self.gather % self.batch_width
        inside = (self.gather < num_rows * self.batch_width) & (position < width)
        return torch.where(inside, row * width + position, num_rows * width)


def bins_needed(lengths: Sequence[int], budget: int) -> int:
    """The fewest bins of ``budget`` tokens first-fit decreasing packs ``lengths`` into."""
    loads: list[int] = []
    for length in sorted(lengths, reverse=True):
        for index, load in enumerate(loads):
            if load + length <= budget:
                loads[index] += length
                break
        else:
            loads.append(length)
    return len(loads)


def assign_bins(lengths: Sequence[int], budget: int, num_bins: int) -> list[list[int]]:
    """``num_bins`` bins of sequence indices (each in increasing order), none empty, every bin at most
    ``budget`` tokens (every length at most ``budget``; ``num_bins`` at least ``bins_needed`` and at most
    the number of sequences): longest first, each to the least-loaded bin it fits in. Where that strands
    a sequence (``num_bins`` is what another rank needed), first-fit decreasing's bins, the empty ones
    then given the shortest sequence of a bin that holds several."""
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    bins = _least_loaded(order, lengths, budget, num_bins)
    if bins is None:
        bins = _first_fit(order, lengths, budget, num_bins)
    return [sorted(members) for members in bins]


def _least_loaded(order: list[int], lengths: Sequence[int], budget: int, num_bins: int) -> list[list[int]] | None:
    loads, bins = [0] * num_bins, [[] for _ in range(num_bins)]
    for index in order:
        fitting = [b for b in range(num_bins) if loads[b] + lengths[index] <= budget]
        if not fitting:
            return None
        target = min(fitting, key=lambda b: (loads[b], b))
        loads[target] += lengths[index]
        bins[target].append(index)
    return bins


def _first_fit(order: list[int], lengths: Sequence[int], budget: int, num_bins: int) -> list[list[int]]:
    loads, bins = [0] * num_bins, [[] for _ in range(num_bins)]
    for index in order:
        target = next(b for b in range(num_bins) if loads[b] + lengths[index] <= budget)
        loads[target] += lengths[index]
        bins[target].append(index)
    for empty in [b for b in range(num_bins) if not bins[b]]:
        donor = next(b for b in range(num_bins) if len(bins[b]) > 1)
        bins[empty].append(bins[donor].pop())  # the donor's shortest: it was placed last
    return bins


def agreed_bins(lengths: Sequence[int], budget: int, group: dist.ProcessGroup | None, device: torch.device) -> int:
    """The number of micro-batches every rank of ``group`` runs: the most any rank needs."""
    needed = torch.tensor(bins_needed(lengths, budget), dtype=torch.int64, device=device)
    if group is not None:
        dist.all_reduce(needed, op=dist.ReduceOp.MAX, group=group)
    return int(needed)


def pack_rows(
    lengths: Sequence[int], batch_width: int, budget: int, num_bins: int, multiple: int, device: torch.device,
    cp_size: int = 1, cp_rank: int = 0,
) -> list[PackedRow]:
    """The packed rows of sequences of ``lengths`` (host ints) right-padded to ``batch_width`` in their
    batch: ``num_bins`` rows of at most ``budget`` real tokens, all of one width (the fullest row's
    tokens rounded up to ``multiple``, at least ``multiple``, which 2 * ``cp_size`` divides), each
    holding CP rank ``cp_rank``'s share of its positions."""
    if max(lengths) > budget:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds the micro-batch budget of {budget} tokens")
    bins = assign_bins(lengths, budget, num_bins)
    fullest = max(sum(lengths[index] for index in members) for members in bins)
    width = max(-(-fullest // multiple) * multiple, multiple)
    mine = zigzag_positions(width, cp_size, cp_rank, device="cpu") if cp_size > 1 else slice(None)
    return [_packed_row(members, lengths, batch_width, width, mine, device) for members in bins]


def _packed_row(members: list[int], lengths: Sequence[int], batch_width: int, width: int,
                mine: torch.Tensor | slice, device: torch.device) -> PackedRow:
    row_lengths = [lengths[index] for index in members]
    used = sum(row_lengths)
    # Built on the host, where the lengths are, and moved once.
    gather = torch.full((width,), len(lengths) * batch_width, dtype=torch.int64, device="cpu")
    sequence_ids = torch.full((width,), len(members), dtype=torch.int64, device="cpu")
    offset = 0
    for number, (index, length) in enumerate(zip(members, row_lengths)):
        gather[offset:offset + length] = torch.arange(index * batch_width, index * batch_width + length, device="cpu")
        sequence_ids[offset:offset + length] = number
        offset += length
    boundaries = [0]
    for length in row_lengths:
        boundaries.append(boundaries[-1] + length)
    if used < width:
        boundaries.append(width)
    # On the host: the layers read the offsets there (their block layouts, the CP pieces), which a copy
    # on the GPU would make a device sync in every layer; the kernels that take them read the device copy.
    cu_seqlens = torch.tensor(boundaries, dtype=torch.int32, device="cpu")
    longest = max(b - a for a, b in zip(boundaries[:-1], boundaries[1:]))
    return PackedRow(
        rows=tuple(members),
        gather=_to_device(gather[mine], device),
        sequence_ids=_to_device(sequence_ids[mine], device)[None],
        num_sequences=len(boundaries) - 1,
        packed_seq_params=PackedRowParams(
            qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=longest,
            max_seqlen_kv=longest, device_cu_seqlens=_to_device(cu_seqlens, device),
        ),
        batch_width=batch_width,
        width=width,
    )


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor's copy on ``device``. To a GPU from pinned memory, without waiting: torch's blocking
    copy waits until the device has run all the work queued before it."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
