"""Lightning attention under context parallelism (models.lightning_cp) on CP = 2 and 4 gloo processes
against the token-by-token recurrence run on the whole row in one process (fp64): outputs and the
gradients of q, k and v of every rank's zigzag chunks.

The rows: documents that do not divide the chunks and cross rank boundaries, a document over 3+
chunks, a padding pseudo-document (zero q, k, v) at the end, a single document, a boundary on every
chunk start (nothing to exchange), and one on some chunk starts only.
"""

from __future__ import annotations

import pytest
import torch

from megacispo.models.lightning import lightning_attention_reference, lightning_decay_rates
from megacispo.parallel.context import zigzag_positions
from megacispo.testing.harness import run_distributed

HEADS, HEAD_DIM = 3, 4
BLOCK = 4  # several kernel blocks per chunk, and documents that start and end mid-block
# Rates 0.16, 0.025 and 0.004 per token: the slow heads carry the state across many chunks.
DECAY = lightning_decay_rates(HEADS, layer_idx=0, num_layers=2, dtype=torch.float64)
EXACT = dict(rtol=1e-10, atol=1e-11)

# cp size -> {case: document lengths of the row}; the row has 12 tokens per rank (chunks of 6).
ROWS = {
    2: {
        "uneven_across_ranks": [5, 9, 3, 7],
        "one_document_over_all_chunks": [24],
        "padding_document_at_end": [11, 10, 3],
        "boundary_on_every_chunk": [6, 12, 6],
        "boundary_on_some_chunks": [12, 2, 10],
    },
    4: {
        "uneven_across_ranks": [5, 9, 3, 7, 13, 11],
        "document_over_5_chunks": [2, 29, 17],
        "padding_document_at_end": [7, 20, 14, 7],
        "one_document_over_all_chunks": [48],
        "boundary_on_every_chunk": [6] * 8,
        "tokens_as_documents_then_a_long_one": [1, 1, 1, 1, 1, 25, 18],
    },
}
PADDED = "padding_document_at_end"


def _row(case: str, doc_lengths: list[int]) -> tuple[torch.Tensor, ...]:
    """q, k, v [1, N, h, d] and an output gradient of one row; zero q, k, v on a padding document."""
    seed = sum(ord(ch) for ch in case) + 7 * len(doc_lengths)
    gen = torch.Generator().manual_seed(seed)
    shape = (1, sum(doc_lengths), HEADS, HEAD_DIM)
    q, k, v, grad_out = (torch.randn(shape, dtype=torch.float64, generator=gen) for _ in range(4))
    if case == PADDED:
        for x in (q, k, v):
            x[:, -doc_lengths[-1] :] = 0
    return q, k, v, grad_out


def _cu_seqlens(doc_lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(doc_lengths).cumsum(0).tolist()], dtype=torch.int32)


def _cp_worker(cp_size: int) -> dict:
    """Every case of ROWS[cp_size] on this rank's zigzag chunks, forward and backward."""
    from megacispo.models.lightning_cp import lightning_attention_cp
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(), seed=0)
    group = torch.distributed.group.WORLD
    rank = group.rank()
    results = {}
    for case, doc_lengths in ROWS[cp_size].items():
        q, k, v, grad_out = _row(case, doc_lengths)
        positions = zigzag_positions(q.shape[1], cp_size, rank)
        local = [x[:, positions].clone().requires_grad_(True) for x in (q, k, v)]
        cu_seqlens = None if len(doc_lengths) == 1 else _cu_seqlens(doc_lengths)  # None: one document
        out = lightning_attention_cp(*local, DECAY, cu_seqlens, group, block_size=BLOCK)
        out.backward(grad_out[:, positions])
        results[case] = {"out": out.detach(), **{f"grad_{n}": x.grad for n, x in zip("qkv", local)}}
    results["errors"] = _bad_input_errors(lightning_attention_cp, group)
    return results


def _bad_input_errors(attention, group) -> list[str]:
    errors = []
    for tokens, cu_seqlens in ((5, None), (6, torch.tensor([0, 4, 6])), (6, torch.tensor([0.0, 12.0]))):
        x = torch.zeros(1, tokens, HEADS, HEAD_DIM, dtype=torch.float64)
        try:
            attention(x, x, x, DECAY, cu_seqlens, group)
        except ValueError as error:
            errors.append(str(error))
    return errors


@pytest.fixture(scope="module", params=sorted(ROWS), ids=lambda cp: f"cp{cp}")
def cp_run(request) -> tuple[int, list[dict]]:
    return request.param, run_distributed(_cp_worker, request.param, request.param)


def _reference(case: str, doc_lengths: list[int]) -> dict[str, torch.Tensor]:
    """The recurrence document by document over the whole row, and its gradients."""
    q, k, v, grad_out = _row(case, doc_lengths)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    outs = [
        lightning_attention_reference(*(x[:, start : start + length] for x in leaves), DECAY)[0]
        for start, length in zip(_cu_seqlens(doc_lengths)[:-1].tolist(), doc_lengths)
    ]
    out = torch.cat(outs, dim=1)
    out.backward(grad_out)
    return {"out": out.detach(), **{f"grad_{n}": x.grad for n, x in zip("qkv", leaves)}}


def test_cp_matches_the_recurrence_on_the_whole_row(cp_run):
    cp_size, results = cp_run
    for case, doc_lengths in ROWS[cp_size].items():
        expected = _reference(case, doc_lengths)
        for rank in range(cp_size):
            positions = zigzag_positions(sum(doc_lengths), cp_size, rank)
            for name, tensor in expected.items():
                torch.testing.assert_close(
                    results[rank][case][name], tensor[:, positions], **EXACT,
                    msg=lambda m, case=case, rank=rank, name=name: f"{case}, rank {rank}, {name}: {m}",
                )


def test_bad_rows_get_one_error_naming_the_fix(cp_run):
    cp_size, results = cp_run
    odd, short, floats = results[0]["errors"]
    assert odd.startswith("this CP rank holds 5 tokens") and f"2 * context_parallel_size = {2 * cp_size}" in odd
    assert f"from 0 to the row's {6 * cp_size} tokens" in short and "got [0, 4, 6]" in short
    assert floats.startswith("cu_seqlens must be a 1-D integer tensor")
