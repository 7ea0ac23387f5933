"""The layout matrix: one RL step and ``megacispo.score`` under each common layout give the
single-process results.

Each layout runs once, in real gloo processes:

- one RL step of the tiny model from the same start weights, through the trainer's own phases:
  rollouts (``Trainer.collect_rollouts``), old log-probs recomputed by the training engine
  (``compute_old_logprobs``) and the update (``update``: Megatron's schedule, DDP, the distributed
  optimizer). The tokens, the rollout and old log-probs, the loss, the entropy and the updated
  parameters equal those of the single-process run: tokens exactly, log-probs to 1e-4 (as
  tests/multiprocess/test_rollout_layouts.py), the loss to 1e-5 and parameters to 1e-5 but for a
  few elements (as tests/multiprocess/test_train_e2e.py; ``assert_same_update`` says why);
- ``megacispo.score``, at the same layout, of the checkpoint that the hub layout (DP 2 x EP 2)
  saved after its step: a checkpoint saved in one layout of the matrix loads in every other and
  gives the log-probs (whose negative mean is the loss) that one process scores from it. The hub
  itself scores the single-process run's checkpoint.

Two choices make the runs comparable. Rollouts are greedy: the trainer seeds one sampling
generator per data-parallel rank, so a DP = 2 run samples other tokens than one process does, while
greedy tokens are a function of the weights alone (a large initialization, std 0.3, keeps greedy
choices far from ties). Greedy groups are uniform, so their group-relative advantages would be zero:
each sample gets a fixed advantage by its global row instead. One update per rollout batch (K = 1)
makes each rank's mini-batch its data-parallel share of the single-process one.

The context-parallel layouts (CP 2 alone and with EP 2, TP 2 and PP 2) split every packed row of
the training passes over two ranks, which generate their rollouts as replicas of their own, and
megacispo.score splits each scored sequence over them alike; they run no metric hook (it refuses CP).

The two expert-TP layouts are those of issue #24: TP 2 and EP 2 with expert TP 1 ("MoE parallel
folding") on 2 processes, and with expert TP 2 on 4 (the dispatcher's uneven all-gathers,
tests/multiprocess/test_uneven_gather.py). The folded layout's scoring of a converted transformers
model also equals transformers' log-probs. The 8-process layouts are in the slow tier
(tests/slow/test_layout_matrix.py). The runs and comparisons are in megacispo.testing.layout_matrix,
the fixtures that run them in tests/conftest.py.
"""

from __future__ import annotations

import pytest
import torch

from megacispo.testing.hf_models import TOLERANCE, convert_and_score, write_hf_model
from megacispo.testing.layout_matrix import (
    ADVANTAGES,
    HUB,
    LAYOUTS,
    LOGPROB_TOLERANCE,
    assert_same_rollouts_and_old_logprobs,
    assert_same_update,
    run_layout,
)


def test_reference_step_learns_something(layout_reference):
    (rank,) = layout_reference.ranks
    assert len(rank["rows"]) == len(ADVANTAGES)
    for row in rank["rows"].values():
        assert row["response_length"] > 1, "every sample has a response to compare"
    assert rank["metrics"]["perf/grad_norm"] > 0 and rank["metrics"]["loss/policy_loss"] != 0
    # The update's first forward runs on the start weights, as the rollouts did.
    expected = rank["probe_start_probs"].mean().item()
    assert 0 < expected < 1 and rank["metrics"]["probe/start_prob"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    "name",
    [pytest.param(name, id=name) for name in LAYOUTS],
)
def test_layout_gives_the_single_process_step_and_scores(layout_workspace, layout_reference, layout_hub,
                                                          hub_checkpoint_scores, name):
    layout = LAYOUTS[name]
    if name == HUB:
        run, expected_scores = layout_hub, layout_reference.scores
    else:
        run = run_layout(layout_workspace, name, layout, layout_hub.checkpoints)
        expected_scores = hub_checkpoint_scores
    assert {rank["expert_tp"] for rank in run.ranks} == {layout.etp or layout.tp}
    assert_same_rollouts_and_old_logprobs(layout_reference, run, name)
    assert_same_update(layout_reference, run, name)
    for actual, expected in zip(run.scores, expected_scores, strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=LOGPROB_TOLERANCE)


def test_folded_experts_score_equals_transformers(tmp_path):
    """Issue #24's command: TP 2 and EP 2 with expert TP 1 on 2 processes, converted and scored with
    --etp 1; the converter records the layout."""
    from megacispo.checkpoint.distributed import read_meta, resolve_checkpoint

    expected = write_hf_model(tmp_path)
    checkpoint, scored = convert_and_score(tmp_path, ["--tp", "2", "--ep", "2", "--etp", "1"], world_size=2)
    parallel = read_meta(resolve_checkpoint(checkpoint))["config"]["parallel"]
    assert (parallel["tensor_model_parallel_size"], parallel["expert_tensor_parallel_size"]) == (2, 1)
    for logprobs, reference in zip(scored, expected, strict=True):
        torch.testing.assert_close(logprobs, reference, rtol=0, atol=TOLERANCE)
