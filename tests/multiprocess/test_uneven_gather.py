"""All-gather and reduce-scatter of shards of different sizes on gloo (the CPU layer's
``_patch_uneven_sequence_collectives``), and the model path that needed them.

Under expert tensor parallelism with EP > 1, Megatron's all-to-all token dispatcher gathers the
tokens routed to this rank's experts from the ranks of the expert-TP group, each of which routed a
different number (``gather_from_sequence_parallel_region`` with ``output_split_sizes``), and
reduce-scatters the experts' outputs back the same way; each one's backward is the other. Gloo
refuses lists of tensors of different sizes. Here the two Megatron functions run forward and
backward on 3 gloo processes with uneven row counts (one rank has none) against the concatenation
and the sums they must give, and the scoring command that crashed in the dispatcher (TP 2, EP 2,
expert TP = TP on 4 processes, on a checkpoint converted with --tp 2 --ep 2) gives transformers'
log-probs.
"""

from __future__ import annotations

import pytest
import torch

from megacispo.testing.harness import run_distributed
from megacispo.testing.hf_models import TOLERANCE, convert_and_score, write_hf_model

SPLIT_SIZES = [3, 0, 5]  # rows of each rank: rank 1 routed no token to this expert-TP group
TRAILING_SHAPES = [(4,), ()]  # hidden states [n, H] and routing probabilities [n]
INPUT, OUTPUT_GRAD = 0, 1  # what a tensor of _values is


def _values(what: int, rank: int, num_rows: int, trailing: tuple[int, ...]) -> torch.Tensor:
    """[num_rows, *trailing] fp64 values of rank ``rank``, different for each kind and shape, so that
    any misplaced row shows (every rank can rebuild every other rank's)."""
    seed = 1000 * what + 100 * rank + 10 * len(trailing) + num_rows
    return torch.randn((num_rows, *trailing), dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _uneven_collectives() -> dict:
    """In each rank: gather this rank's rows, and reduce-scatter a full-length tensor, through
    Megatron's sequence-parallel mappings with uneven split sizes; each output then goes backward."""
    from megatron.core.tensor_parallel import (
        gather_from_sequence_parallel_region,
        reduce_scatter_to_sequence_parallel_region,
    )

    from megacispo.parallel.layout import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(), seed=0)
    group = torch.distributed.group.WORLD
    rank = torch.distributed.get_rank()
    results = {}
    total_rows, my_rows = sum(SPLIT_SIZES), SPLIT_SIZES[rank]
    for trailing in TRAILING_SHAPES:
        local = _values(INPUT, rank, my_rows, trailing).requires_grad_(True)
        gathered = gather_from_sequence_parallel_region(local, group=group, output_split_sizes=SPLIT_SIZES)
        gathered.backward(_values(OUTPUT_GRAD, rank, total_rows, trailing))
        full = _values(INPUT, rank, total_rows, trailing).requires_grad_(True)
        scattered = reduce_scatter_to_sequence_parallel_region(full, group=group, input_split_sizes=SPLIT_SIZES)
        scattered.backward(_values(OUTPUT_GRAD, rank, my_rows, trailing))
        results[trailing] = {"gathered": gathered.detach(), "gathered_input_grad": local.grad,
                             "scattered": scattered.detach(), "scattered_input_grad": full.grad}
    return results


@pytest.fixture(scope="module")
def collectives() -> list[dict]:
    return run_distributed(_uneven_collectives, len(SPLIT_SIZES))


def _block(tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a tensor laid out in SPLIT_SIZES blocks."""
    start = sum(SPLIT_SIZES[:rank])
    return tensor[start : start + SPLIT_SIZES[rank]]


@pytest.mark.parametrize("trailing", TRAILING_SHAPES, ids=["hidden", "probs"])
def test_gather_concatenates_and_its_backward_sums_each_ranks_rows(collectives, trailing):
    ranks = range(len(SPLIT_SIZES))
    every_rows = torch.cat([_values(INPUT, rank, SPLIT_SIZES[rank], trailing) for rank in ranks])
    gradient_sum = sum(_values(OUTPUT_GRAD, rank, sum(SPLIT_SIZES), trailing) for rank in ranks)
    for rank in ranks:
        result = collectives[rank][trailing]
        torch.testing.assert_close(result["gathered"], every_rows, rtol=0, atol=0)
        torch.testing.assert_close(result["gathered_input_grad"], _block(gradient_sum, rank), rtol=1e-12, atol=0)


@pytest.mark.parametrize("trailing", TRAILING_SHAPES, ids=["hidden", "probs"])
def test_reduce_scatter_sums_each_ranks_block_and_its_backward_gathers(collectives, trailing):
    ranks = range(len(SPLIT_SIZES))
    total = sum(_values(INPUT, rank, sum(SPLIT_SIZES), trailing) for rank in ranks)
    every_output_grad = torch.cat([_values(OUTPUT_GRAD, rank, SPLIT_SIZES[rank], trailing) for rank in ranks])
    for rank in ranks:
        result = collectives[rank][trailing]
        torch.testing.assert_close(result["scattered"], _block(total, rank), rtol=1e-12, atol=0)
        torch.testing.assert_close(result["scattered_input_grad"], every_output_grad, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# The model path: converting and scoring a transformers model under expert tensor parallelism


def test_expert_tensor_parallel_score_equals_transformers(tmp_path):
    """TP 2 and EP 2 with expert TP following TP on 4 processes: issue #24's crash in the dispatcher."""
    expected = write_hf_model(tmp_path)
    _, scored = convert_and_score(tmp_path, ["--tp", "2", "--ep", "2"], world_size=4)
    for logprobs, reference in zip(scored, expected, strict=True):
        torch.testing.assert_close(logprobs, reference, rtol=0, atol=TOLERANCE)
