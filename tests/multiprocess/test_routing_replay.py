"""Routing replay (R3) and the router-disagreement count, on the tiny model.

A bfloat16 rollout records each token's experts; the fp32 training forward, through Megatron's
schedule in 2 micro-batches (each slicing the recorded experts with its samples), routes some of
them elsewhere on its own (the disagreement count sees them), and with replay routes every recorded
token exactly where the rollout did: in one process, at EP = 2, at TP = 2 with sequence parallelism
(each rank's router sees its slice of the sequence) and at PP = 2 (two gloo processes each).
Replay off computes bit for bit what a forward without any routing targets computes, and
model.freeze_router keeps the routers' weights through an optimizer step while the others move.
"""

from __future__ import annotations

import torch

from megacispo.testing.harness import run_distributed
from megacispo.testing.parallel_case import one_update

PROMPT_LENGTHS = (5, 12, 3, 20, 8, 9, 2, 14)
EOS, PAD = 2, 0
NEW_TOKENS = 10


def _prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]


def _batch(samples, multiple: int):
    """The samples as the trainer batches them, right-padded to a multiple of ``multiple`` positions
    (sequence parallelism splits the sequence over the TP ranks)."""
    from megacispo.data.padding import pad_right
    from megacispo.rl.trainer import TrainBatch

    width = -(-samples.tokens.shape[1] // multiple) * multiple
    extra = width - samples.tokens.shape[1]
    return TrainBatch(tokens=torch.nn.functional.pad(samples.tokens, (0, extra), value=PAD),
                      loss_mask=torch.nn.functional.pad(samples.loss_mask, (0, extra)),
                      advantages=torch.zeros(len(samples.tokens), device="cpu"),
                      rollout_logprobs=torch.nn.functional.pad(samples.rollout_logprobs, (0, extra)),
                      padding_mask=samples.padding_mask(width), routes=pad_right(samples.routes, width))


def _routing_maps(model) -> dict[int, list[torch.Tensor]]:
    """Forward hooks on every router of this stage: {global layer: [routing map [T, E] of each call]}."""
    maps: dict[int, list[torch.Tensor]] = {}
    for layer in model.decoder.layers:
        def hook(module, inputs, outputs, index=layer.layer_number - 1):
            maps.setdefault(index, []).append(outputs[1].clone())
        layer.mlp.router.register_forward_hook(hook)
    return maps


def _training_forward(model, batch, micro_batches: int, *, compare: bool, replay: bool) -> list[torch.Tensor]:
    """This stage's outputs of a forward-only pass of ``batch`` in ``micro_batches`` micro-batches
    through Megatron's schedule, routing as the trainer does."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megacispo.rl.trainer import routing_targets

    size = len(batch) // micro_batches
    micros = [batch.slice(i * size, (i + 1) * size) for i in range(micro_batches)]
    outputs = []

    def forward_step(data_iterator, model):
        micro = next(data_iterator)
        hidden = model(micro.tokens, return_hidden_states=True, padding_mask=micro.padding_mask,
                       routing=routing_targets(micro, compare=compare, replay=replay))
        outputs.append(hidden.detach().clone())
        return hidden, lambda output: (output.float().sum() * 0, {})

    with torch.no_grad():
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micros), model=[model],
                                    num_microbatches=micro_batches, seq_length=batch.tokens.shape[1],
                                    micro_batch_size=size, forward_only=True)
    return outputs


def _replay_case(layout: dict) -> dict:
    """Roll out in bfloat16, then run the fp32 training forward without and with replay. Returns the
    disagreement counts added over ranks and whether every replayed routing matched the rollout's."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.models.routing import local_targets
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.rl.trainer import routing_targets
    from megacispo.rollout.config import RolloutConfig
    from megacispo.rollout.generate import generate, sample_keys

    model_cfg = model_config("tiny")
    parallel = ParallelConfig(**layout)
    init_distributed(parallel, seed=7)
    model = HybridModel(model_cfg, transformer_config(model_cfg, parallel),
                        pre_process=parallel_state.is_pipeline_first_stage(),
                        post_process=parallel_state.is_pipeline_last_stage())
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    share = len(PROMPT_LENGTHS) // dp_size
    rows = list(range(dp_rank * share, (dp_rank + 1) * share))
    prompts = _prompts(model_cfg.vocab_size)
    config = RolloutConfig(max_new_tokens=NEW_TOKENS, temperature=1.0, dtype="bfloat16", max_running=3)
    samples = generate(model, [prompts[row] for row in rows], config, stop_ids=[EOS], pad_id=PAD,
                       keys=sample_keys((1, 0), rows, 1, device="cpu"),
                       lockstep_group=parallel_state.get_data_parallel_group())
    sp_rank = parallel_state.get_tensor_model_parallel_rank() if parallel.sequence_parallel else None
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    batch = _batch(samples, tp_size)
    model.eval()
    free = _training_forward(model, batch, 2, compare=False, replay=False)
    compared = _training_forward(model, batch, 2, compare=True, replay=False)
    counts_free = model.take_route_counts()
    maps = _routing_maps(model)
    _training_forward(model, batch, 2, compare=True, replay=True)
    counts_replayed = model.take_route_counts()
    matched, checked = True, 0
    for index, layer in enumerate(model.decoder.layers):
        layer_maps = maps[layer.layer_number - 1]
        for micro, routing_map in enumerate(layer_maps):
            micro_batch = batch.slice(micro * len(batch) // 2, (micro + 1) * len(batch) // 2)
            targets = routing_targets(micro_batch, compare=True, replay=True)
            expected = local_targets(targets.experts[:, :, index], sp_rank, tp_size).long().sort(dim=-1).values
            recorded = local_targets(targets.recorded, sp_rank, tp_size)
            chosen = routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1)
            matched &= torch.equal(chosen[recorded], expected[recorded])
            checked += int(recorded.sum())
    counts = torch.stack([counts_free, counts_replayed])
    dist.all_reduce(counts)
    return {
        "counts": counts.sum(dim=1), "matched": matched, "checked": checked,
        "bit_identical": len(free) == len(compared) and all(torch.equal(a, b) for a, b in zip(free, compared)),
        "route_dtype": samples.routes.dtype, "route_shape": tuple(samples.routes.shape),
        "layers": len(model.decoder.layers),
    }


def _check(results: list[dict]) -> None:
    for result in results:
        assert result["matched"], "a replayed token was routed elsewhere than the rollout routed it"
        assert result["checked"] > 0
        assert result["bit_identical"], "comparing without replay changed the forward's output"
        assert result["route_dtype"] == torch.uint8
    (free_differ, free_compared), (replay_differ, replay_compared) = results[0]["counts"].tolist()
    assert free_compared > 0 and free_compared == replay_compared
    # The bf16 rollout flips some top-k choices of the fp32 router, and replay does not change what
    # the router itself would choose (the count compares its own top-k).
    assert free_differ > 0, "no routing flipped between the bf16 rollout and the fp32 forward"
    assert replay_differ == free_differ


def test_replay_matches_the_rollout_in_one_process():
    (result,) = run_distributed(_replay_case, 1, {})
    _check([result])
    assert result["route_shape"][2:] == (8, 2)  # [n, S, layers, top-k]


def test_replay_matches_the_rollout_at_ep2():
    _check(run_distributed(_replay_case, 2, {"expert_model_parallel_size": 2}))


def test_replay_matches_the_rollout_at_tp2_with_sequence_parallelism():
    _check(run_distributed(_replay_case, 2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}))


def test_replay_matches_the_rollout_at_pp2():
    results = run_distributed(_replay_case, 2, {"pipeline_model_parallel_size": 2})
    _check(results)
    assert [r["layers"] for r in results] == [4, 4]


def _freeze_case() -> dict:
    from megacispo.parallel.layout import init_distributed
    from megacispo.startup import run_config
    from megacispo.training.engine import Engine

    config = run_config(None, ["model.size=tiny", "model.freeze_router=true", "train.run_dir=unused",
                                "optimizer.warmup_steps=0"])
    init_distributed(config.parallel, seed=1)
    engine = Engine(config, total_steps=1, peak_lr=1e-2)
    result, moved = one_update(engine, torch.randint(3, 512, (2, 16), device="cpu"))
    return {"applied": result.applied, "moved": moved}


def test_freeze_router_keeps_router_weights():
    (result,) = run_distributed(_freeze_case, 1)
    assert result["applied"]
    routers = {name: moved for name, moved in result["moved"].items() if ".router." in name}
    others = {name: moved for name, moved in result["moved"].items() if ".router." not in name}
    assert routers and not any(routers.values()), f"router weights moved: {routers}"
    assert sum(others.values()) > len(others) // 2, "the other weights did not move"
