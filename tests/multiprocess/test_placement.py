"""Placement (megacispo.rollout.placement): the start-up checks of placement.rollout_ranks, the weight sync
from any training layout to the rollout processes' whole replicas, bit for bit, in buckets, and the bridge's
liveness bound on a rollout process that stops."""

from __future__ import annotations

import os

import pytest
import torch

from megacispo.testing.harness import run_distributed


# Small enough to cut the tiny model into several buckets, and some of its tensors between two.
BUCKET_BYTES = 512 << 10


def _no_tensor_pickled(tensor, protocol):
    raise AssertionError(f"a tensor of shape {tuple(tensor.shape)} was pickled")


def _sync(parallel: dict) -> dict:
    """2 training processes in ``parallel``'s layout and 1 rollout process: one weight sync in buckets of
    BUCKET_BYTES, with no tensor pickled. Training ranks return their pieces of the weights, the rollout
    process its whole replica's, after the sync; each the collectives it called during it."""
    from unittest import mock

    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.parallel.sharded import parameter_pieces
    from megacispo.rollout.placement import start_placement
    from megacispo.rollout.weight_sync import WeightsHeader, publish_weights, receive_weights
    from megacispo.startup import run_config
    from megacispo.testing.op_counter import OpCounter
    from megacispo.training.engine import Engine, build_inference_model

    config = run_config(None, [f"parallel.{key}={value}" for key, value in parallel.items()] + [
        "placement.rollout_ranks=1", "optimizer.use_distributed_optimizer=false"])
    side = start_placement(config.placement, config.parallel)
    counter = OpCounter()
    no_pickling = mock.patch.object(torch.Tensor, "__reduce_ex__", _no_tensor_pickled)
    if side.is_rollout:
        init_distributed(ParallelConfig(), seed=0)
        model = build_inference_model(config.model, "float32", ParallelConfig())
        with counter, no_pickling:
            header = side.bridge.broadcast_object()
            assert isinstance(header, WeightsHeader)
            receive_weights(model, side.bridge, header)
        # The bridge's own group is a backend object, whose collectives bypass the dispatcher (and the
        # counter): the bridge counts the broadcasts it received.
        return {"version": header.version, "pieces": parameter_pieces(model), "broadcasts": side.bridge._received[0],
                "collectives": _collectives(counter), "buckets": len(header.buckets)}
    init_distributed(config.parallel, seed=0)
    engine = Engine(config, total_steps=1, peak_lr=1e-3)
    with counter, no_pickling:
        publish_weights(engine.module, side.bridge, version=7, bucket_bytes=BUCKET_BYTES)
    if side.bridge is not None:
        side.bridge.flush()
    return {"pieces": parameter_pieces(engine.module), "collectives": _collectives(counter)}


def _collectives(counter) -> int:
    return sum(count for name, count in counter.by_op.items() if name.startswith("c10d::"))


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
    # A collective per bucket, not per tensor: the rollout process receives the header (its length and
    # its bytes) and the buckets; each training rank exchanges where its pieces sit (all_gather_object:
    # the sizes, then the bytes), then reduces every bucket onto training rank 0, which broadcasts it.
    buckets = rollout["buckets"]
    assert 3 <= buckets < len(expected) // 4
    total_bytes = sum(tensor.nbytes for tensor in expected.values())
    assert buckets <= total_bytes // BUCKET_BYTES + 2, "one bucket per dtype at most beyond the full ones"
    assert rollout["broadcasts"] == 2 + buckets and rollout["collectives"] == 0
    assert training_0["collectives"] == training_1["collectives"] == 2 + buckets


def _stopped_mid_round(liveness_timeout_s: float) -> dict:
    """1 training and 1 rollout process. The rollout process sends its pid, then stays silent for 3
    liveness bounds (as generating a long round) before it sends a share; the training process receives
    it, stops the rollout process (SIGSTOP: alive to the operating system, gone to the bridge, as a
    process that NCCL's wait() cannot see) and waits for the next share."""
    import signal
    import time

    from megacispo.rollout.placement import RolloutProcessLost, start_placement
    from megacispo.startup import run_config

    config = run_config(None, ["placement.rollout_ranks=1", "parallel.expert_model_parallel_size=1",
                               f"placement.liveness_timeout_s={liveness_timeout_s}"])
    bridge = start_placement(config.placement, config.parallel).bridge
    if bridge.rank == 1:
        bridge.send_object(os.getpid())
        time.sleep(3 * liveness_timeout_s)
        bridge.send_object("a share")
        stop = bridge.broadcast_object()
        bridge.flush()
        return {"stop": stop}
    pid = bridge.receive_object(1)
    start = time.monotonic()
    share = bridge.receive_object(1)
    silent_s = time.monotonic() - start
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(RolloutProcessLost) as lost:
            bridge.receive_object(1, "its share of a round")
        lost_after_s = time.monotonic() - start
    finally:
        os.kill(pid, signal.SIGCONT)
    bridge.broadcast_object("stop")
    bridge.flush()
    return {"share": share, "silent_s": silent_s, "lost_after_s": lost_after_s, "error": str(lost.value)}


def test_a_stopped_rollout_process_is_reported_within_the_liveness_bound():
    training, rollout = run_distributed(_stopped_mid_round, 2, 1.0, timeout_s=120)
    # Silent but alive for 3 bounds: waited for; stopped: reported after the bound, well before any timeout.
    assert training["share"] == "a share" and training["silent_s"] >= 3.0
    assert 1.0 <= training["lost_after_s"] < 2.5, training
    assert training["error"].startswith("rollout process 0 of 1 (rank 1 of the world) stopped answering")
    assert "the liveness bound is 1 s" in training["error"] and "for its share of a round" in training["error"]
    assert rollout["stop"] == "stop"


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


def _lora_sync() -> dict:
    """2 training processes (EP 2) with LoRA adapters and 1 rollout process: the first sync sends every
    weight, a later one (after the adapters moved) the adapters alone; the rollout process returns its
    replica's pieces and the keys of each sync."""
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.parallel.sharded import parameter_pieces
    from megacispo.rollout.placement import start_placement
    from megacispo.models.config import ADAPTERS
    from megacispo.rollout.weight_sync import publish_weights, receive_weights
    from megacispo.startup import run_config
    from megacispo.training.engine import Engine, build_inference_model

    config = run_config(None, ["parallel.expert_model_parallel_size=2", "placement.rollout_ranks=1", "lora.rank=4",
                               "train.load=unused", "optimizer.use_distributed_optimizer=false"])
    side = start_placement(config.placement, config.parallel)
    if side.is_rollout:
        init_distributed(ParallelConfig(), seed=0)
        model = build_inference_model(config.model, "float32", ParallelConfig(), config.lora)
        keys = []
        for _ in range(2):
            header = side.bridge.broadcast_object()
            receive_weights(model, side.bridge, header)
            keys.append(sorted(header.entries))
        return {"keys": keys, "pieces": parameter_pieces(model)}
    init_distributed(config.parallel, seed=0)
    engine = Engine(config, total_steps=1, peak_lr=1e-3)
    publish_weights(engine.module, side.bridge, version=0, bucket_bytes=BUCKET_BYTES)
    with torch.no_grad():
        for name, param in engine.module.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0.0, 0.01, generator=torch.Generator().manual_seed(len(name)))
    publish_weights(engine.module, side.bridge, version=1, bucket_bytes=BUCKET_BYTES, weights=ADAPTERS)
    if side.bridge is not None:
        side.bridge.flush()
    return {"pieces": parameter_pieces(engine.module)}


def test_lora_syncs_send_the_adapters_alone_after_the_first():
    from megacispo.parallel.sharded import assemble

    training_0, training_1, rollout = run_distributed(_lora_sync, 3, timeout_s=300)
    expected = assemble([training_0["pieces"], training_1["pieces"]])
    actual = assemble([rollout["pieces"]])
    assert expected.keys() == actual.keys()
    assert all(torch.equal(actual[key], expected[key]) for key in expected)
    first, later = rollout["keys"]
    assert first == sorted(expected) and later == sorted(key for key in expected if key.endswith(("lora_A", "lora_B")))
    assert any(key.endswith("lora_B") and expected[key].abs().max() > 0 for key in expected)
