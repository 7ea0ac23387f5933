"""A step's sequences moved between the data-parallel ranks so that each rank's share of every
mini-batch holds about the same number of tokens.

Each data-parallel rank trains the samples it generated. With long-tailed lengths one rank may hold
the few long responses and the others short ones; packed micro-batches then carry very different
tokens per rank, and every rank waits at each collective (the expert all-to-all of every micro-batch,
the gradient reduction) for the fullest one. After the rollout the ranks exchange their sequences'
lengths (one all-gather of n ints each) and, for every mini-batch of the step, split its sequences
(every rank's rows of that mini-batch together) into equal-count parts of about equal tokens: longest
first, each to the lightest part with room (LPT). A part goes to the rank that already holds most of
its rows, and the rows move with one all-to-all per tensor; a mini-batch that LPT would not make
lighter on its fullest rank stays where it is. Deterministic: the same lengths give the
same parts on every rank and every machine.

It changes no number the step computes: the loss is normalized by the step's global token count
(megacispo.rl.losses.compute_global_counts) and the gradients are summed over the ranks, so which
rank trains a sequence does not matter; each mini-batch keeps its sequences, so the K updates see the
same data. Each rank keeps as many rows as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist


def balanced_parts(lengths: Sequence[int], num_parts: int) -> list[list[int]]:
    """``num_parts`` parts of the indices of ``lengths`` (len(lengths) a multiple of num_parts), each of
    len(lengths) / num_parts indices in increasing order: longest first (ties by index), each to the part
    of least total with room left (ties by part)."""
    if len(lengths) % num_parts:
        raise ValueError(f"{len(lengths)} sequences do not split into {num_parts} parts of equal count")
    room = len(lengths) // num_parts
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    loads = [0] * num_parts
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = min((p for p in range(num_parts) if len(parts[p]) < room), key=lambda p: (loads[p], p))
        parts[target].append(index)
        loads[target] += lengths[index]
    return [sorted(part) for part in parts]


def owners_of_parts(parts: list[list[int]], rows_per_rank: int) -> list[int]:
    """The rank each part goes to (a permutation of the ranks): parts in order of size of their largest
    overlap, each to the free rank that already holds most of its rows (global row i is row
    i % rows_per_rank of rank i // rows_per_rank), ties to the lower rank."""
    num_ranks = len(parts)
    overlap = [[0] * num_ranks for _ in parts]
    for part, members in enumerate(parts):
        for index in members:
            overlap[part][index // rows_per_rank] += 1
    owners = [-1] * len(parts)
    free = set(range(num_ranks))
    for part in sorted(range(len(parts)), key=lambda p: (-max(overlap[p]), p)):
        owners[part] = max(sorted(free), key=lambda rank: overlap[part][rank])
        free.remove(owners[part])
    return owners


@dataclass(frozen=True)
class Balance:
    """Where every rank's rows go: ``new_rows[r]`` lists the global rows (rank * n + row) that rank r
    holds after the exchange, in its new row order."""

    new_rows: list[list[int]]
    rows_per_rank: int

    @staticmethod
    def plan(lengths: list[list[int]], num_slices: int) -> Balance:
        """The balance of ranks holding ``lengths[r]`` (n each, a multiple of ``num_slices``): rows
        [k n / K, (k + 1) n / K) of every rank form mini-batch k, which is balanced on its own."""
        num_ranks, rows = len(lengths), len(lengths[0])
        if any(len(rank_lengths) != rows for rank_lengths in lengths) or rows % num_slices:
            raise ValueError(f"every rank must hold the same rows, a multiple of {num_slices} mini-batches: "
                             f"got {[len(rank_lengths) for rank_lengths in lengths]}")
        size = rows // num_slices
        new_rows: list[list[int]] = [[] for _ in range(num_ranks)]
        for k in range(num_slices):
            members = [rank * rows + row for rank in range(num_ranks) for row in range(k * size, (k + 1) * size)]
            parts = balanced_parts([lengths[i // rows][i % rows] for i in members], num_ranks)
            parts = [[members[i] for i in part] for part in parts]
            owners = owners_of_parts(parts, rows)
            ranks_now = [[index for index in members if index // rows == rank] for rank in range(num_ranks)]
            if _heaviest(parts, lengths, rows) >= _heaviest(ranks_now, lengths, rows):
                parts, owners = ranks_now, list(range(num_ranks))  # no better than it is: nothing moves
            for part, owner in zip(parts, owners):
                new_rows[owner] += part
        return Balance(new_rows, rows)

    def destinations(self, rank: int) -> list[int]:
        """The rank each of ``rank``'s rows goes to."""
        where = {index: owner for owner, rows in enumerate(self.new_rows) for index in rows}
        return [where[rank * self.rows_per_rank + row] for row in range(self.rows_per_rank)]


def _heaviest(parts: list[list[int]], lengths: list[list[int]], rows: int) -> int:
    return max(sum(lengths[index // rows][index % rows] for index in part) for part in parts)


def token_spread(lengths: list[list[int]]) -> float:
    """The fullest rank's tokens over the mean rank's (1.0: balanced)."""
    totals = [sum(rank_lengths) for rank_lengths in lengths]
    return max(totals) * len(totals) / max(sum(totals), 1)


def exchange_rows(tensors: Sequence[torch.Tensor], balance: Balance, group: dist.ProcessGroup) -> list[torch.Tensor]:
    """Each of this rank's [n, ...] ``tensors`` (the same shape on every rank of ``group``) with its rows
    replaced by the rows ``balance`` gives this rank, in that order: one all-to-all per tensor."""
    rank, num_ranks, rows = group.rank(), group.size(), balance.rows_per_rank
    destinations = balance.destinations(rank)
    send_order = sorted(range(rows), key=lambda row: (destinations[row], row))
    send_counts = [destinations.count(peer) for peer in range(num_ranks)]
    incoming = sorted(balance.new_rows[rank])  # they arrive by source rank, each source's rows in order
    receive_counts = [sum(1 for index in incoming if index // rows == peer) for peer in range(num_ranks)]
    placed = [incoming.index(index) for index in balance.new_rows[rank]]
    device = tensors[0].device
    send_index = torch.tensor(send_order, dtype=torch.long, device=device)
    new_order = torch.tensor(placed, dtype=torch.long, device=device)
    exchanged = []
    for tensor in tensors:
        # gloo's all-to-all takes no bool: bools travel as bytes.
        wire = tensor.view(torch.uint8) if tensor.dtype == torch.bool else tensor
        received = torch.empty_like(wire)
        dist.all_to_all_single(received, wire[send_index].contiguous(), receive_counts, send_counts, group=group)
        received = received[new_order]
        exchanged.append(received.view(torch.bool) if tensor.dtype == torch.bool else received)
    return exchanged
