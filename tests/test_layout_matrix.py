"""The layout matrix: one RL step and ``megacispo.score`` under each common layout give the
single-process results.

Each layout runs once, in real gloo processes:

- one RL step of the tiny model from the same start weights, through the trainer's own phases:
  rollouts (``Trainer.collect_rollouts``), old log-probs recomputed by the training engine
  (``compute_old_logprobs``) and the update (``update``: Megatron's schedule, DDP, the distributed
  optimizer). The tokens, the rollout and old log-probs, the loss, the entropy and the updated
  parameters equal those of the single-process run: tokens exactly, log-probs to 1e-4 (as
  tests/test_rollout_layouts.py), the loss to 1e-5 and parameters to 1e-5 but for a few elements
  (as tests/test_train_e2e.py; ``_assert_same_update`` says why);
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

The two expert-TP layouts are those of issue #24: TP 2 and EP 2 with expert TP 1 ("MoE parallel
folding") on 2 processes, and with expert TP 2 on 4 (the dispatcher's uneven all-gathers,
tests/test_uneven_gather.py). The folded layout's scoring of a converted transformers model also
equals transformers' log-probs. The 8-process layouts are marked slow.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from multiprocess_harness import run_distributed
from parallel_case import save_random_tiny_checkpoint
from megacispo.parallel.sharded import assemble

REPO = Path(__file__).parent.parent
LR = 1e-3
MAX_NEW_TOKENS = 8
# One advantage per sample of the global batch (rollout.prompts_per_step x rollout.group_size); of
# mixed signs but no zero sum, which would leave the loss a small difference of large terms.
ADVANTAGES = (1.0, 0.4, -0.3, 0.7)
INIT_STD = 0.3
# Sequences to score: one across the tiny model's lightning block of 16 and odd under TP = 2.
SCORED = [list(range(5, 46)), [7, 300, 12, 9, 411], [1, 2]]
LOGPROB_TOLERANCE = 1e-4
# logging.probe_token: its start probability is a mean over the batch, reduced over DP like the loss.
PROBE_TOKEN = "1"  # quoted in the override, or YAML reads a number


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    """None: expert TP follows TP."""

    def config_overrides(self) -> list[str]:
        fields = {"tensor_model_parallel_size": self.tp, "pipeline_model_parallel_size": self.pp,
                  "expert_model_parallel_size": self.ep, "sequence_parallel": self.tp > 1}
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
}
SLOW_LAYOUTS = {
    "tp2_pp2_ep2": Layout(world_size=8, tp=2, pp=2, ep=2),
    "tp2_pp2_dp2": Layout(world_size=8, tp=2, pp=2),
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """Task prompts, a tokenizer and the start weights, shared by every layout."""
    root = tmp_path_factory.mktemp("layout_matrix")
    python = sys.executable
    subprocess.run([python, "tools/make_task_data.py", "--out", str(root / "task"), "--task", "addition",
                    "--digits", "2", "--num-train", "16", "--num-test", "2", "--seed", "0"],
                   cwd=REPO, check=True, capture_output=True)
    subprocess.run([python, "tools/train_tokenizer.py", "--input", str(root / "task" / "corpus.txt"),
                    "--vocab-size", "512", "--out", str(root / "tok")], cwd=REPO, check=True, capture_output=True)
    run_distributed(save_random_tiny_checkpoint, 1, str(root / "start"), 0, INIT_STD)
    (root / "scored.jsonl").write_text("".join(json.dumps({"tokens": tokens}) + "\n" for tokens in SCORED))
    return root


def _run_overrides(workspace: Path, run_dir: Path) -> list[str]:
    pairs = {
        "data.train_prompts": workspace / "task" / "train.jsonl",
        "data.tokenizer": workspace / "tok" / "tokenizer.model",
        "rollout.prompts_per_step": 2, "rollout.group_size": 2, "rollout.max_new_tokens": MAX_NEW_TOKENS,
        "rollout.temperature": 0.0, "rollout.dynamic_sampling": False,
        "rl.updates_per_rollout": 1, "optimizer.lr": LR, "logging.probe_token": f"'{PROBE_TOKEN}'",
        "train.run_dir": run_dir, "train.load": workspace / "start", "train.micro_batch_size": 2,
    }
    return [f"{key}={value}" for key, value in pairs.items()]


def _rl_step_then_score(overrides: list[str], score_argv: list[str]) -> dict:
    """In each rank: one RL step from the start weights (saved as the run's checkpoint afterwards),
    then megacispo.score at the same layout. Returns this rank's view of the step."""
    from megatron.core import parallel_state

    from megacispo import score
    from megacispo.cli import load_tokenizer
    from megacispo.config import load_config
    from megacispo.data import load_prompts
    from megacispo.engine import Engine
    from megacispo.metrics import MetricsLogger
    from megacispo.models.config import model_shape
    from megacispo.parallel.layout import init_distributed, validate_layout, world_size_from_env
    from megacispo.parallel.sharded import parameter_pieces
    from megacispo.trainer import Trainer

    config = load_config(None, overrides)
    validate_layout(config.parallel, world_size_from_env(), model_shape(config.model))
    init_distributed(config.parallel, config.train.seed)
    engine = Engine(config, total_steps=1, peak_lr=config.optimizer.lr)
    trainer = Trainer(config, engine, load_tokenizer(config), load_prompts(config.data.train_prompts), [],
                      MetricsLogger(config.train.run_dir, enabled=False))
    trainer.load_initial_weights()

    batch, _ = trainer.collect_rollouts()
    rows = (trainer.dp_rank * len(batch) + torch.arange(len(batch))).tolist()
    batch.advantages = torch.tensor(ADVANTAGES, device=engine.device)[rows]
    batch.old_logprobs = trainer.compute_old_logprobs(batch)
    start_probs = _probe_start_probs(trainer, batch) if parallel_state.get_tensor_model_parallel_world_size() == \
        parallel_state.get_pipeline_model_parallel_world_size() == 1 else None
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
    return logits[torch.arange(len(batch)), first].softmax(dim=-1)[:, trainer.probe_id]


@dataclass
class LayoutRun:
    ranks: list[dict]
    """Each rank's view of the RL step."""
    scores: list[torch.Tensor]
    """megacispo.score's log-probs of SCORED."""
    checkpoints: Path
    """The run's checkpoints root (its step's checkpoint)."""


def run_layout(workspace: Path, name: str, layout: Layout, scored_checkpoints: Path | None) -> LayoutRun:
    """One RL step and one scoring at ``layout``; scoring reads ``scored_checkpoints`` (None: the
    run's own checkpoint)."""
    run_dir = workspace / name
    checkpoints = run_dir / "checkpoints"
    out = run_dir / "scored.jsonl"
    score_argv = ["--load", str(scored_checkpoints or checkpoints), "--tokens", str(workspace / "scored.jsonl"),
                  "--out", str(out), *layout.score_args()]
    overrides = _run_overrides(workspace, run_dir) + layout.config_overrides()
    ranks = run_distributed(_rl_step_then_score, layout.world_size, overrides, score_argv, timeout_s=600)
    return LayoutRun(ranks, _read_scores(out), checkpoints)


def _read_scores(path: Path) -> list[torch.Tensor]:
    return [torch.tensor(json.loads(line)["logprobs"]) for line in path.read_text().splitlines()]


def _score(argv: list[str]) -> int:
    from megacispo.score import main

    return main(argv)


@pytest.fixture(scope="module")
def reference(workspace) -> LayoutRun:
    return run_layout(workspace, "single", SINGLE_PROCESS, scored_checkpoints=None)


@pytest.fixture(scope="module")
def hub(workspace, reference) -> LayoutRun:
    return run_layout(workspace, HUB, LAYOUTS[HUB], scored_checkpoints=reference.checkpoints)


@pytest.fixture(scope="module")
def hub_checkpoint_scores(workspace, hub) -> list[torch.Tensor]:
    """What one process scores from the hub's checkpoint: its weights differ from the single-process
    run's where Adam's first step went the other way (``_assert_same_update``), which moves log-probs
    by up to 5e-3."""
    out = workspace / "hub_checkpoint_scored.jsonl"
    run_distributed(_score, 1, ["--load", str(hub.checkpoints), "--tokens", str(workspace / "scored.jsonl"),
                                "--out", str(out)])
    return _read_scores(out)


def test_reference_step_learns_something(reference):
    (rank,) = reference.ranks
    assert len(rank["rows"]) == len(ADVANTAGES)
    for row in rank["rows"].values():
        assert row["response_length"] > 1, "every sample has a response to compare"
    assert rank["metrics"]["perf/grad_norm"] > 0 and rank["metrics"]["loss/policy_loss"] != 0
    # The update's first forward runs on the start weights, as the rollouts did.
    expected = rank["probe_start_probs"].mean().item()
    assert 0 < expected < 1 and rank["metrics"]["probe/start_prob"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    "name",
    [pytest.param(name, id=name) for name in LAYOUTS]
    + [pytest.param(name, id=name, marks=pytest.mark.slow) for name in SLOW_LAYOUTS],
)
def test_layout_gives_the_single_process_step_and_scores(workspace, reference, hub, hub_checkpoint_scores, name):
    layout = {**LAYOUTS, **SLOW_LAYOUTS}[name]
    if name == HUB:
        run, expected_scores = hub, reference.scores
    else:
        run = run_layout(workspace, name, layout, hub.checkpoints)
        expected_scores = hub_checkpoint_scores
    assert {rank["expert_tp"] for rank in run.ranks} == {layout.etp or layout.tp}
    _assert_same_rollouts_and_old_logprobs(reference, run, name)
    _assert_same_update(reference, run, name)
    for actual, expected in zip(run.scores, expected_scores, strict=True):
        torch.testing.assert_close(actual, expected, rtol=0, atol=LOGPROB_TOLERANCE)


def _assert_same_rollouts_and_old_logprobs(reference: LayoutRun, run: LayoutRun, name: str) -> None:
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


def _assert_same_update(reference: LayoutRun, run: LayoutRun, name: str) -> None:
    """The loss and entropy (on every last-stage rank, reduced over data parallelism) and every
    updated parameter equal the single-process step's."""
    (expected_rank,) = reference.ranks
    for rank in (r for r in run.ranks if r["last_stage"]):
        for key in ("loss/policy_loss", "loss/entropy", "probe/start_prob", "probe/tokens"):
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


def test_folded_experts_score_equals_transformers(tmp_path):
    """Issue #24's command: TP 2 and EP 2 with expert TP 1 on 2 processes, converted and scored with
    --etp 1; the converter records the layout."""
    from test_uneven_gather import TOLERANCE, convert_and_score, write_hf_model

    from megacispo.checkpoint import read_meta, resolve_checkpoint

    expected = write_hf_model(tmp_path)
    checkpoint, scored = convert_and_score(tmp_path, ["--tp", "2", "--ep", "2", "--etp", "1"], world_size=2)
    parallel = read_meta(resolve_checkpoint(checkpoint))["config"]["parallel"]
    assert (parallel["tensor_model_parallel_size"], parallel["expert_tensor_parallel_size"]) == (2, 1)
    for logprobs, reference in zip(scored, expected, strict=True):
        torch.testing.assert_close(logprobs, reference, rtol=0, atol=TOLERANCE)
