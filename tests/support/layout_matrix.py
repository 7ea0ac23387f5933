"""The layout matrix's runs (tests/multiprocess/test_layout_matrix.py, whose docstring says what is
compared and why; tests/slow/test_layout_matrix.py runs the 8-process layouts): the layouts, one RL
step and one scoring at a layout in real gloo processes, and the comparisons with the single-process
run. The fixtures that run them are in tests/conftest.py."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from megacispo.parallel.sharded import assemble
from megacispo.testing.harness import run_distributed
from megacispo.testing.parallel_case import save_random_tiny_checkpoint

REPO = Path(__file__).resolve().parents[2]
LR = 1e-3
MAX_NEW_TOKENS = 8
# One advantage per sample of the global batch (rollout.prompts_per_step x rollout.group_size); of
# mixed signs but no zero sum, which would leave the loss a small difference of large terms.
ADVANTAGES = (1.0, 0.4, -0.3, 0.7)
INIT_STD = 0.3
# Sequences to score: one across the tiny model's lightning block of 16 and odd under TP = 2.
SCORED = [list(range(5, 46)), [7, 300, 12, 9, 411], [1, 2]]
LOGPROB_TOLERANCE = 1e-4
# logging.metric_hooks.probe_token: its start probability is a mean over the batch, reduced over DP like the loss.
PROBE_TOKEN = "1"  # quoted in the override, or YAML reads a number


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    """None: expert TP follows TP."""
    cp: int = 1
    """Context parallelism: no metric hooks (they refuse it)."""

    def config_overrides(self) -> list[str]:
        fields = {"tensor_model_parallel_size": self.tp, "pipeline_model_parallel_size": self.pp,
                  "expert_model_parallel_size": self.ep, "sequence_parallel": self.tp > 1,
                  "context_parallel_size": self.cp}
        if self.etp is not None:
            fields["expert_tensor_parallel_size"] = self.etp
        return [f"parallel.{key}={value}" for key, value in fields.items()]

    def score_args(self) -> list[str]:
        return [arg for override in self.config_overrides() for arg in ("--set", override)]


SINGLE_PROCESS = Layout(world_size=1)
HUB = "dp2_ep2"
LAYOUTS = {
    "tp2_ep2_etp1": Layout(world_size=2, tp=2, ep=2, etp=1),
    "tp2_ep2_etp2": Layout(world_size=4, tp=2, ep=2),
    "tp2_pp2": Layout(world_size=4, tp=2, pp=2),
    "pp2_ep2": Layout(world_size=4, pp=2, ep=2),
    HUB: Layout(world_size=2, ep=2),
    "tp2_dp2_sp": Layout(world_size=4, tp=2),
    "cp2": Layout(world_size=2, cp=2),
    "cp2_ep2": Layout(world_size=2, ep=2, cp=2),
    "cp2_tp2_sp": Layout(world_size=4, tp=2, cp=2),
    "cp2_pp2": Layout(world_size=4, pp=2, cp=2),
}
SLOW_LAYOUTS = {
    "tp2_pp2_ep2": Layout(world_size=8, tp=2, pp=2, ep=2),
    "tp2_pp2_dp2": Layout(world_size=8, tp=2, pp=2),
}


def make_layout_workspace(root: Path, size: str = "tiny") -> Path:
    """Task prompts, a tokenizer and the start weights of the model ``size`` in ``root``, shared by every
    layout."""
    python = sys.executable
    subprocess.run([python, "tools/make_task_data.py", "--out", str(root / "task"), "--task", "addition",
                    "--digits", "2", "--num-train", "16", "--num-test", "2", "--seed", "0"],
                   cwd=REPO, check=True, capture_output=True)
    subprocess.run([python, "tools/train_tokenizer.py", "--input", str(root / "task" / "corpus.txt"),
                    "--vocab-size", "512", "--out", str(root / "tok")], cwd=REPO, check=True, capture_output=True)
    run_distributed(save_random_tiny_checkpoint, 1, str(root / "start"), 0, INIT_STD, size)
    (root / "scored.jsonl").write_text("".join(json.dumps({"tokens": tokens}) + "\n" for tokens in SCORED))
    return root


def _run_overrides(workspace: Path, run_dir: Path, probe: bool, size: str) -> list[str]:
    pairs = {
        "model.size": size,
        "data.train_prompts": workspace / "task" / "train.jsonl",
        "data.tokenizer": workspace / "tok" / "tokenizer.model",
        "rollout.prompts_per_step": 2, "rollout.group_size": 2, "rollout.max_new_tokens": MAX_NEW_TOKENS,
        "rollout.temperature": 0.0, "rollout.dynamic_sampling": False,
        "rl.updates_per_rollout": 1, "optimizer.lr": LR,
        "train.run_dir": run_dir, "train.load": workspace / "start", "train.micro_batch_size": 2,
    }
    if probe:
        pairs["logging.metric_hooks.probe_token.token"] = f"'{PROBE_TOKEN}'"
    return [f"{key}={value}" for key, value in pairs.items()]


def _rl_step_then_score(overrides: list[str], score_argv: list[str]) -> dict:
    """In each rank: one RL step from the start weights (saved as the run's checkpoint afterwards),
    then megacispo.score at the same layout. Returns this rank's view of the step."""
    from megatron.core import parallel_state

    from megacispo import score
    from megacispo.data.prompts import load_prompts
    from megacispo.metrics.logger import MetricsLogger
    from megacispo.models.config import model_shape
    from megacispo.parallel.layout import init_distributed, validate_layout, world_size_from_env
    from megacispo.parallel.sharded import parameter_pieces
    from megacispo.rl.metric_hooks import build_metric_hooks
    from megacispo.rl.trainer import Trainer
    from megacispo.startup import load_tokenizer, run_config
    from megacispo.training.engine import Engine

    config = run_config(None, overrides)
    validate_layout(config.parallel, world_size_from_env(), model_shape(config.model))
    init_distributed(config.parallel, config.train.seed)
    engine = Engine(config, total_steps=1, peak_lr=config.optimizer.lr)
    tokenizer = load_tokenizer(config)
    trainer = Trainer(config, engine, tokenizer, load_prompts(config.data.train_prompts), [],
                      MetricsLogger(config.train.run_dir, enabled=False),
                      metric_hooks=build_metric_hooks(config.logging.metric_hooks, tokenizer))
    trainer.load_initial_weights()

    batch, _ = trainer.collect_rollouts()
    rows = (trainer.dp_rank * len(batch) + torch.arange(len(batch))).tolist()
    batch.advantages = torch.tensor(ADVANTAGES, device=engine.device)[rows]
    batch.old_logprobs = trainer.compute_old_logprobs(batch)
    start_probs = _probe_start_probs(trainer, batch) if trainer.metric_hooks and \
        parallel_state.get_tensor_model_parallel_world_size() == parallel_state.get_pipeline_model_parallel_world_size() \
        == 1 else None
    metrics = trainer.update(batch)
    trainer.save()

    lengths = (~batch.padding_mask).sum(dim=1).tolist()
    result = {
        "rows": {row: {"tokens": batch.tokens[i, :length], "response_length": int(batch.loss_mask[i].sum()),
                       "rollout_logprobs": batch.rollout_logprobs[i, : length - 1],
                       "old_logprobs": batch.old_logprobs[i, : length - 1]}
                 for i, (row, length) in enumerate(zip(rows, lengths))},
        "metrics": metrics,
        "probe_start_probs": start_probs,
        "last_stage": parallel_state.is_pipeline_last_stage(),
        "expert_tp": parallel_state.get_expert_tensor_parallel_world_size(),
        "params": parameter_pieces(engine.module),
    }
    parallel_state.destroy_model_parallel()
    score.run(score_argv)
    return result


@torch.no_grad()
def _probe_start_probs(trainer, batch) -> torch.Tensor:
    """[n] each row's probability of the probe token at its response's first position, from the whole
    logits of one forward (TP = PP = 1): what the trainer's probe/start_prob averages."""
    logits = trainer.engine.module(batch.tokens, padding_mask=batch.padding_mask).float()  # [n, S, V]
    first = batch.loss_mask.argmax(dim=1)  # the position predicting each response's first token
    return logits[torch.arange(len(batch)), first].softmax(dim=-1)[:, trainer.metric_hooks[0].token_id]


@dataclass
class LayoutRun:
    ranks: list[dict]
    """Each rank's view of the RL step."""
    scores: list[torch.Tensor] | None
    """megacispo.score's log-probs of SCORED."""
    checkpoints: Path
    """The run's checkpoints root (its step's checkpoint)."""


def run_layout(workspace: Path, name: str, layout: Layout, scored_checkpoints: Path | None,
               size: str = "tiny") -> LayoutRun:
    """One RL step of the model ``size`` (the workspace's) and one scoring at ``layout``; scoring reads
    ``scored_checkpoints`` (None: the run's own checkpoint)."""
    run_dir = workspace / name
    checkpoints = run_dir / "checkpoints"
    out = run_dir / "scored.jsonl"
    score_argv = ["--load", str(scored_checkpoints or checkpoints), "--tokens", str(workspace / "scored.jsonl"),
                  "--out", str(out), *layout.score_args()]
    overrides = _run_overrides(workspace, run_dir, layout.cp == 1, size) + layout.config_overrides()
    ranks = run_distributed(_rl_step_then_score, layout.world_size, overrides, score_argv, timeout_s=600)
    return LayoutRun(ranks, read_scores(out), checkpoints)


def read_scores(path: Path) -> list[torch.Tensor]:
    return [torch.tensor(json.loads(line)["logprobs"]) for line in path.read_text().splitlines()]


def _score(argv: list[str]) -> int:
    from megacispo.score import main

    return main(argv)


def score_in_one_process(workspace: Path, checkpoints: Path) -> list[torch.Tensor]:
    """What one process scores from ``checkpoints``' newest checkpoint."""
    out = workspace / "hub_checkpoint_scored.jsonl"
    run_distributed(_score, 1, ["--load", str(checkpoints), "--tokens", str(workspace / "scored.jsonl"),
                                "--out", str(out)])
    return read_scores(out)


def assert_same_rollouts_and_old_logprobs(reference: LayoutRun, run: LayoutRun, name: str) -> None:
    """Every rank holds its rows of the single-process batch (TP and PP ranks hold the same rows)."""
    (expected_rank,) = reference.ranks
    expected = expected_rank["rows"]
    covered = set()
    for rank in run.ranks:
        for row, actual in rank["rows"].items():
            assert torch.equal(actual["tokens"], expected[row]["tokens"]), f"{name}: row {row} tokens differ"
            for key in ("rollout_logprobs", "old_logprobs"):
                torch.testing.assert_close(actual[key], expected[row][key], rtol=LOGPROB_TOLERANCE,
                                           atol=LOGPROB_TOLERANCE, msg=lambda detail: f"{name} {key} row {row}: {detail}")
            covered.add(row)
    assert covered == set(expected), f"{name}: rows {sorted(set(expected) - covered)} missing"


def assert_same_update(reference: LayoutRun, run: LayoutRun, name: str) -> None:
    """The loss and entropy (on every last-stage rank, reduced over data parallelism) and every
    updated parameter equal the single-process step's."""
    (expected_rank,) = reference.ranks
    for rank in (r for r in run.ranks if r["last_stage"]):
        probe = ("probe/start_prob", "probe/tokens") if "probe/tokens" in rank["metrics"] else ()
        for key in ("loss/policy_loss", "loss/entropy", *probe):
            assert rank["metrics"][key] == pytest.approx(expected_rank["metrics"][key], rel=1e-5, abs=1e-7), (name, key)
    expected = assemble([expected_rank["params"]])
    actual = assemble([rank["params"] for rank in run.ranks])
    assert actual.keys() == expected.keys()
    # Adam's first step moves each element by lr * g / (|g| + 1e-15), lr * sign(g) for any gradient
    # g != 0: an element whose gradient is zero up to fp32 rounding (which differs between layouts)
    # may step either way, 2 lr apart. That happens at a few elements; the rest agree to 1e-5.
    for key in expected:
        difference = (actual[key] - expected[key]).abs()
        assert difference.max() <= 2 * LR * (1 + 1e-3), (name, key, difference.max())
        assert (difference > 1e-5).sum() <= max(1, difference.numel() // 1000), (name, key, (difference > 1e-5).sum())
