"""Placement (megacispo.rollout.placement): the start-up checks of placement.rollout_ranks, and the weight sync
from any training layout to the rollout processes' whole replicas, bit for bit."""

from __future__ import annotations

import pytest
import torch

from megacispo.testing.harness import run_distributed


def _sync(parallel: dict) -> dict:
    """2 training processes in ``parallel``'s layout and 1 rollout process: one weight sync. Training
    ranks return their pieces of the weights, the rollout process its whole replica's, after the sync."""
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.parallel.sharded import parameter_pieces
    from megacispo.rollout.placement import start_placement
    from megacispo.rollout.weight_sync import WeightsHeader, publish_weights, receive_weights
    from megacispo.startup import run_config
    from megacispo.training.engine import Engine, build_inference_model

    config = run_config(None, [f"parallel.{key}={value}" for key, value in parallel.items()] + [
        "placement.rollout_ranks=1", "optimizer.use_distributed_optimizer=false"])
    side = start_placement(config.placement, config.parallel)
    if side.is_rollout:
        init_distributed(ParallelConfig(), seed=0)
        model = build_inference_model(config.model, "float32", ParallelConfig())
        header = side.bridge.broadcast_object()
        assert isinstance(header, WeightsHeader)
        receive_weights(model, side.bridge, header)
        return {"version": header.version, "pieces": parameter_pieces(model)}
    init_distributed(config.parallel, seed=0)
    engine = Engine(config, total_steps=1, peak_lr=1e-3)
    publish_weights(engine.module, side.bridge, version=7)
    if side.bridge is not None:
        side.bridge.flush()
    return {"pieces": parameter_pieces(engine.module)}


@pytest.mark.parametrize("parallel", [
    {"tensor_model_parallel_size": 2, "sequence_parallel": "true"},
    {"expert_model_parallel_size": 2},
    {"pipeline_model_parallel_size": 2},
], ids=["tp2", "ep2", "pp2"])
def test_sync_gives_the_rollout_process_the_training_weights_bit_for_bit(parallel):
    from megacispo.parallel.sharded import assemble

    training_0, training_1, rollout = run_distributed(_sync, 3, parallel, timeout_s=300)
    assert rollout["version"] == 7
    expected = assemble([training_0["pieces"], training_1["pieces"]])
    # The rollout replica is whole: one piece per tensor (each expert a piece of its stacked key).
    actual = assemble([rollout["pieces"]])
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key
    alone = assemble([training_0["pieces"]])
    assert alone.keys() != expected.keys() or any(not torch.equal(alone[key], expected[key]) for key in expected), (
        "training rank 0 holds the whole model: the layout split nothing")


def _dry_run_error(monkeypatch, world_size: int, overrides: list[str]) -> str:
    from megacispo.startup import BadInput
    from megacispo.train import main

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(BadInput) as raised:
        main(["--dry-run", *[arg for pair in overrides for arg in ("--set", pair)]])
    return str(raised.value)


@pytest.mark.parametrize("world_size, overrides, message", [
    (2, ["placement.rollout_ranks=2"], r"placement.rollout_ranks = 2 leaves no training process in a world of 2"),
    (3, ["placement.rollout_ranks=1", "parallel.expert_model_parallel_size=4"],
     r"world size 2 is not divisible by .* = 1 \* 4 \* 1 = 4"),
    (3, ["placement.rollout_ranks=2", "rollout.prompts_per_step=3"],
     r"rollout.prompts_per_step = 3 is not divisible by placement.rollout_ranks = 2"),
    (2, ["rollout.max_staleness=1"], r"rollout.max_staleness = 1 needs placement.rollout_ranks > 0"),
    (2, ["placement.rollout_ranks=-1"], r"placement.rollout_ranks = -1: it must be >= 0"),
])
def test_placement_errors_at_start_up_name_the_fields(monkeypatch, world_size, overrides, message):
    import re

    assert re.search(message, _dry_run_error(monkeypatch, world_size, overrides))


def test_a_placed_run_plans_the_training_processes(monkeypatch, capsys):
    from megacispo.train import main

    monkeypatch.setenv("WORLD_SIZE", "3")
    argv = ["--dry-run", "--set", "placement.rollout_ranks=1", "--set", "parallel.expert_model_parallel_size=2"]
    assert main(argv) == 0
    assert "layout: world 2 = TP 1 x PP 1 x CP 1 x DP 2; EP 2" in capsys.readouterr().out
