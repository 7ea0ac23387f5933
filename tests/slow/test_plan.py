"""tools/plan.py's activation estimate against the tensors the real model saves for backward, under
tensor and sequence parallelism (2 processes; tests/multiprocess/test_plan.py has the rest)."""

from __future__ import annotations

from megacispo.testing.saved_activations import compare_with_the_model


def test_estimate_matches_what_the_model_saves_under_tensor_and_sequence_parallelism():
    compare_with_the_model({"tensor_model_parallel_size": 2, "sequence_parallel": True}, world_size=2)
