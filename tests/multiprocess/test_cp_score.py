"""Long documents under context parallelism: megacispo.score and the sequence-mean losses at CP 2 and 4
compute what one rank computes.

- megacispo.score of the tiny HF-made M1 (seven lightning layers and a softmax one, sequences of 7, 1,
  41 and 20 tokens: rows padded to 2 x CP) at CP 2 and 4, both softmax schemes (all_gather, p2p),
  equals CP 1 to 1e-5 (absolute and relative) and transformers to 1e-4 (fp32).
- gspo (the sequence ratio, whose per-sequence sums of log-ratios and token counts are all-reduced over
  the CP ranks) and grpo (sequence-mean normalization), one update of the trainer's packed rows on the
  tiny model: the loss, the metrics and every gradient at CP 2 (and CP 4) equal CP 1's to 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megacispo.testing.harness import run_distributed
from megacispo.testing.hf_models import SEQUENCES, write_hf_model
from megacispo.testing.parallel_case import assert_close_by_key
from tests.multiprocess.test_packing import _budget_for, _pass

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

# fp32, CP against CP 1: absolute and relative (log-probs reach -8, where fp32's spacing is 1e-6).
CP_TOLERANCE = 1e-5
HF_TOLERANCE = 1e-4  # fp32: against transformers (megacispo.testing.hf_models.TOLERANCE)
COMMS = ("all_gather", "p2p")


def _score_layouts(root: str, cp: int) -> None:
    """megacispo.score of root/hf at CP 1 (the world data-parallel) and at CP = ``cp`` with each softmax scheme."""
    from megacispo import score

    root = Path(root)
    runs = {"cp1": []} | {f"cp{cp}_{comm}": ["--set", f"parallel.context_parallel_size={cp}",
                                             "--set", f"parallel.context_parallel_comm={comm}"] for comm in COMMS}
    for name, settings in runs.items():
        score.run(["--load", str(root / "hf"), "--tokens", str(root / "tokens.jsonl"),
                   "--out", str(root / f"{name}.jsonl"), *settings])


def _scored(root: Path, name: str) -> list[torch.Tensor]:
    return [torch.tensor(json.loads(line)["logprobs"], dtype=torch.float64)
            for line in (root / f"{name}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_score_under_context_parallelism_equals_one_rank_and_transformers(tmp_path, cp):
    reference = write_hf_model(tmp_path)
    run_distributed(_score_layouts, cp, str(tmp_path), cp)
    one_rank = _scored(tmp_path, "cp1")
    for tokens, expected, logprobs in zip(SEQUENCES, reference, one_rank):
        assert len(logprobs) == len(tokens) - 1
        torch.testing.assert_close(logprobs, expected, rtol=0, atol=HF_TOLERANCE)
    for comm in COMMS:
        for index, (expected, logprobs) in enumerate(zip(one_rank, _scored(tmp_path, f"cp{cp}_{comm}"))):
            torch.testing.assert_close(logprobs, expected, rtol=CP_TOLERANCE, atol=CP_TOLERANCE,
                                       msg=lambda m: f"CP {cp} {comm}, sequence {index}: {m}")


def _assert_same_update(expected: dict, actual: dict, what: str) -> None:
    torch.testing.assert_close(actual["old_logprobs"], expected["old_logprobs"], rtol=CP_TOLERANCE,
                               atol=CP_TOLERANCE, msg=lambda m: f"{what}: old log-probs: {m}")
    for key in ("loss/policy_loss", "loss/num_tokens", "loss/clip_frac_high", "loss/clip_frac_low", "perf/grad_norm"):
        assert actual["metrics"][key] == pytest.approx(expected["metrics"][key], rel=CP_TOLERANCE, abs=1e-7), \
            (what, key, actual["metrics"][key], expected["metrics"][key])
    assert_close_by_key(expected["grads"], actual["grads"], f"{what}: gradient of", rtol=CP_TOLERANCE)


@pytest.mark.parametrize(("loss", "cp"), [
    ("gspo", 2),
    pytest.param("grpo", 2, marks=pytest.mark.slow),
    pytest.param("gspo", 4, marks=pytest.mark.slow),
])
def test_sequence_mean_losses_under_context_parallelism_equal_one_rank(loss, cp):
    """The 16 sequences of tests/multiprocess/test_packing.py in 2 packed rows: each row's sequences
    split over the CP ranks (zigzag), the per-sequence sums taken over them. The old log-probs are the
    model's own (ratio 1): each token's gradient is its advantage over its sequence's token count, which
    a rank's own piece of the sequence would get wrong."""
    budget = _budget_for(2)
    (one_rank,) = run_distributed(_pass, 1, True, budget, loss)
    for result in run_distributed(_pass, cp, True, budget, loss, {"context_parallel_size": cp}):
        assert result["micro_batches"] == 2
        _assert_same_update(one_rank, result, f"{loss} at CP = {cp}")
