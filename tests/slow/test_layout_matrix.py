"""The layout matrix's 8-process layouts (TP 2 x PP 2 with EP 2 or DP 2): one RL step and
``megacispo.score`` give the single-process results, as tests/multiprocess/test_layout_matrix.py
checks for the others (its docstring says what is compared and why)."""

from __future__ import annotations

import pytest
import torch

from megacispo.testing.layout_matrix import (
    LOGPROB_TOLERANCE,
    SLOW_LAYOUTS,
    assert_same_rollouts_and_old_logprobs,
    assert_same_update,
    run_layout,
)


@pytest.mark.parametrize("name", [pytest.param(name, id=name) for name in SLOW_LAYOUTS])
def test_layout_gives_the_single_process_step_and_scores(layout_workspace, layout_reference, layout_hub,
                                                          hub_checkpoint_scores, name):
    layout = SLOW_LAYOUTS[name]
    run = run_layout(layout_workspace, name, layout, layout_hub.checkpoints)
    assert {rank["expert_tp"] for rank in run.ranks} == {layout.etp or layout.tp}
    assert_same_rollouts_and_old_logprobs(layout_reference, run, name)
    assert_same_update(layout_reference, run, name)
    for actual, expected in zip(run.scores, hub_checkpoint_scores, strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=LOGPROB_TOLERANCE)
