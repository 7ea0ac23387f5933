"""Context-parallel softmax attention in real gloo processes against one process's attention over the
whole packed row (softmax_attention.attend_documents), in fp64: the outputs and the gradients of q, k
and v of every rank's zigzag tokens, for both schemes: K and V all-gathered (models.softmax_cp.
attention_cp) and passed round a ring (attention_cp_ring).

The row of 48 tokens holds documents of odd lengths and a trailing padding document, laid so that
at CP = 2 (chunks of 12) and CP = 4 (chunks of 6) documents cross chunk and rank boundaries and
one document spans at least three chunks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megacispo.models.softmax_attention import attend_documents
from megacispo.models.softmax_cp import attention_cp, attention_cp_ring, ring_pieces
from megacispo.parallel.context import packed_document_ids, zigzag_positions
from megacispo.parallel.layout import ParallelConfig, init_distributed
from megacispo.testing.harness import run_distributed

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
LENGTHS = [7, 3, 21, 9, 8]  # 21 covers positions 10..30; the last document is the row's padding
TOTAL = sum(LENGTHS)
SCALE = HEAD_DIM**-0.5


def _row() -> dict[str, torch.Tensor]:
    """The whole packed row's q, k, v, the output gradient and cu_seqlens, the same in every process."""
    generator = torch.Generator().manual_seed(3)

    def draw(heads: int) -> torch.Tensor:
        return torch.randn(1, heads, TOTAL, HEAD_DIM, dtype=torch.float64, generator=generator)

    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return dict(q=draw(HEADS), k=draw(KV_HEADS), v=draw(KV_HEADS), upstream=draw(HEADS), cu_seqlens=cu_seqlens)


SCHEMES = {"all_gather": attention_cp, "p2p": attention_cp_ring}


def _cp_rank(scheme: str) -> dict[str, torch.Tensor]:
    """One CP rank: its zigzag tokens of the row through ``scheme``'s attention, forward and backward."""
    init_distributed(ParallelConfig(), seed=0)
    row = _row()
    positions = zigzag_positions(TOTAL, dist.get_world_size(), dist.get_rank())
    q, k, v = (row[name][:, :, positions].clone().requires_grad_(True) for name in ("q", "k", "v"))
    out = SCHEMES[scheme](q, k, v, row["cu_seqlens"], dist.group.WORLD, SCALE)
    out.backward(row["upstream"][:, :, positions])
    return dict(positions=positions, out=out.detach(), q=q.grad, k=k.grad, v=v.grad)


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("cp_size", [2, 4])
def test_attention_cp_matches_one_process(cp_size, scheme):
    row = _row()
    chunks = torch.arange(TOTAL) // (TOTAL // (2 * cp_size))
    documents = packed_document_ids(row["cu_seqlens"], torch.arange(TOTAL))
    chunks_per_document = [chunks[documents == number].unique().numel() for number in range(len(LENGTHS))]
    assert max(chunks_per_document) >= 3, f"no document spans three chunks at CP = {cp_size}"
    q, k, v = (row[name].clone().requires_grad_(True) for name in ("q", "k", "v"))
    out = attend_documents(q, k, v, row["cu_seqlens"], max(LENGTHS), SCALE)
    out.backward(row["upstream"])
    expected = dict(out=out.detach(), q=q.grad, k=k.grad, v=v.grad)

    ranks = run_distributed(_cp_rank, cp_size, scheme, timeout_s=120)
    covered = torch.cat([rank["positions"] for rank in ranks]).sort().values
    assert torch.equal(covered, torch.arange(TOTAL))
    for rank in ranks:
        for name, full in expected.items():
            torch.testing.assert_close(rank[name], full[:, :, rank["positions"]], rtol=1e-12, atol=1e-12)


def test_zigzag_positions_reject_a_row_that_does_not_split():
    with pytest.raises(ValueError, match="a multiple of 2 \\* 4 = 8; pad the row to 56 tokens"):
        zigzag_positions(50, 4, 0)


def test_ring_pieces_cover_each_query_once_per_visible_key():
    """Over the CP steps of the ring, the pieces of every rank cover exactly the (query, key) pairs of the
    causal document mask, each once: at CP = 4, brute force over the 48 x 48 pairs."""
    row = _row()
    offsets = row["cu_seqlens"].tolist()
    documents = packed_document_ids(row["cu_seqlens"], torch.arange(TOTAL))
    cp_size, chunk = 4, TOTAL // 8
    seen = torch.zeros(TOTAL, TOTAL, dtype=torch.long)
    for rank in range(cp_size):
        mine = zigzag_positions(TOTAL, cp_size, rank)
        for source in range(cp_size):
            theirs = zigzag_positions(TOTAL, cp_size, source)
            for queries, keys, causal in ring_pieces(offsets, chunk, cp_size, rank, source):
                for i, query in enumerate(mine[queries].tolist()):
                    for j, key in enumerate(theirs[keys].tolist()):
                        seen[query, key] += int(not causal or j <= i)
    positions = torch.arange(TOTAL)
    expected = (documents[:, None] == documents[None, :]) & (positions[None, :] <= positions[:, None])
    assert torch.equal(seen, expected.long())
