"""The layout matrix (tests/multiprocess/test_layout_matrix.py, whose docstring says what is compared
and why) on the tiny MiniMax-M2 (#57): one RL step from one random checkpoint at TP 2 x EP 2, PP 2 x
EP 2, TP 2 x DP 2 with sequence parallelism and CP 2 gives the single-process step's rollouts, old
log-probs, loss and updated parameters (QK-norm weights and selection biases among them), and
``megacispo.score`` of the DP 2 x EP 2 hub's checkpoint gives one process's log-probs."""

from __future__ import annotations

import pytest
import torch

from megacispo.testing.layout_matrix import (
    HUB,
    LAYOUTS,
    LOGPROB_TOLERANCE,
    SINGLE_PROCESS,
    assert_same_rollouts_and_old_logprobs,
    assert_same_update,
    make_layout_workspace,
    run_layout,
    score_in_one_process,
)

SIZE = "tiny-m2"
M2_LAYOUTS = ("tp2_ep2_etp1", "pp2_ep2", "tp2_dp2_sp", "cp2")


@pytest.fixture(scope="module")
def m2_workspace(tmp_path_factory):
    return make_layout_workspace(tmp_path_factory.mktemp("m2_layout_matrix"), SIZE)


@pytest.fixture(scope="module")
def m2_reference(m2_workspace):
    return run_layout(m2_workspace, "single", SINGLE_PROCESS, None, SIZE)


@pytest.fixture(scope="module")
def m2_hub(m2_workspace, m2_reference):
    return run_layout(m2_workspace, HUB, LAYOUTS[HUB], m2_reference.checkpoints, SIZE)


@pytest.fixture(scope="module")
def m2_hub_scores(m2_workspace, m2_hub):
    return score_in_one_process(m2_workspace, m2_hub.checkpoints)


@pytest.mark.parametrize("name", [HUB, *M2_LAYOUTS])
def test_m2_layout_gives_the_single_process_step_and_scores(m2_workspace, m2_reference, m2_hub, m2_hub_scores, name):
    run = m2_hub if name == HUB else run_layout(m2_workspace, name, LAYOUTS[name], m2_hub.checkpoints, SIZE)
    assert_same_rollouts_and_old_logprobs(m2_reference, run, name)
    assert_same_update(m2_reference, run, name)
    expected = m2_reference.scores if name == HUB else m2_hub_scores
    for actual, wanted in zip(run.scores, expected, strict=True):
        torch.testing.assert_close(actual, wanted, rtol=0, atol=LOGPROB_TOLERANCE)
