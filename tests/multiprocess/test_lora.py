"""LoRA in one process: with B = 0 the model is the base, bit for bit; a rollout's merged weights compute
what the unmerged adapters do; one update moves the adapters alone; the checkpoint of a LoRA run holds
its adapters alone, loads over the base it was trained on and refuses another base, and a model without
adapters refuses it."""

from __future__ import annotations

import pytest
import torch

from megacispo.testing.harness import run_distributed
from megacispo.testing.parallel_case import one_update, save_random_tiny_checkpoint

LORA = ["lora.rank=4", "lora.alpha=8", "train.load=unused", "optimizer.use_distributed_optimizer=false"]


def _model_cases(root: str) -> dict:
    from megacispo.checkpoint.distributed import CheckpointError, load_checkpoint, save_checkpoint
    from megacispo.checkpoint.hf import load_start_weights
    from megacispo.config import to_dict
    from megacispo.models.lora import adapted_linears, base_fingerprint, same_base
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.startup import run_config
    from megacispo.training.engine import Engine

    init_distributed(ParallelConfig(), seed=3)
    tokens = torch.randint(1, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    base_dir = f"{root}/base"
    config = run_config(None, [*LORA, f"train.load={base_dir}/step_00000000"])
    engine = Engine(config, total_steps=1, peak_lr=1e-2)
    load_start_weights("train.load", config.train.load, engine)
    plain = Engine(run_config(None, ["optimizer.use_distributed_optimizer=false"]), total_steps=1, peak_lr=1e-2)
    load_start_weights("train.load", config.train.load, plain)
    model = engine.module
    with torch.no_grad():
        zero_b_equal = torch.equal(model.eval()(tokens), plain.module.eval()(tokens))
    model.train()
    result, moved = one_update(engine, tokens)
    fingerprint = base_fingerprint(model)
    run_dir = f"{root}/run"
    step_dir = save_checkpoint(run_dir, 1, model, engine.optimizer, engine.scheduler, config_dict=to_dict(config))
    adapters = {name: param.detach().clone() for name, param in model.named_parameters() if param.requires_grad}
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.zero_()
    load_checkpoint(step_dir, model, engine.optimizer, engine.scheduler)
    reloaded = all(torch.equal(param, adapters[name])
                   for name, param in model.named_parameters() if param.requires_grad)
    with torch.no_grad():
        plain.module.embedding.word_embeddings.weight.add_(1e-3)
    other_base = base_fingerprint(plain.module)
    with torch.no_grad():
        plain.module.embedding.word_embeddings.weight.sub_(1e-3)
    try:
        load_checkpoint(step_dir, plain.module, load_rng=False)
        refused_without_adapters = None
    except CheckpointError as error:
        refused_without_adapters = str(error)
    plain.module.double()
    # Exact math (fp64) for the merge: W x + s B A x and (W + s B A) x differ by rounding alone.
    model.eval().double()
    with torch.no_grad():
        generator = torch.Generator().manual_seed(2)
        for linear in adapted_linears(model):
            linear.lora_B.copy_(torch.randn(linear.lora_B.shape, generator=generator) * 0.002)
        unmerged = model(tokens)  # [b, s, V]
        with model.generation_dtype(torch.float32):
            merged = model(tokens)
            merged_flags = {linear.adapters_merged for linear in adapted_linears(model)}
            # The lean decode step, on the stacks the rollout merged as it made them.
            _, cache = model.prefill(tokens[:, :-1])
            stepped, _ = model.decode_step(tokens[:, -1], cache)
            lean = model._lean_step_applies(cache)
        after_flags = {linear.adapters_merged for linear in adapted_linears(model)}
        base_logits = plain.module.eval()(tokens)
    return {
        "zero_b_equal": zero_b_equal,
        "merged_error": ((merged - unmerged).abs().max() / unmerged.abs().max()).item(),
        "merged_dtype": merged.dtype,
        "step_error": ((stepped - unmerged[:, -1]).abs().max() / unmerged.abs().max()).item(),
        "lean": lean,
        "adapter_effect": (unmerged - base_logits).abs().max().item(),
        "merged_flags": merged_flags, "after_flags": after_flags,
        "applied": result.applied,
        "moved": {name for name, changed in moved.items() if changed},
        "trainable": {name for name, param in model.named_parameters() if param.requires_grad},
        "reloaded": reloaded,
        "refused_without_adapters": refused_without_adapters,
        "same_base": same_base(fingerprint, base_fingerprint(plain.module)),
        "other_base": same_base(fingerprint, other_base),
    }


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    run_distributed(save_random_tiny_checkpoint, 1, str(root / "base"), 0, 0.3)
    (result,) = run_distributed(_model_cases, 1, str(root))
    return result


def test_zero_b_is_the_base_bit_for_bit(cases):
    assert cases["zero_b_equal"]


def test_rollout_merges_the_adapters(cases):
    assert cases["adapter_effect"] > 1e-3  # the adapters change the logits ...
    assert cases["merged_dtype"] == torch.float64
    assert cases["merged_error"] < 1e-12  # ... and the merged weights compute the same
    assert cases["merged_flags"] == {True} and cases["after_flags"] == {False}
    # The lean step's own gap to the forward (fp32 decay factors): 2.6e-6 without adapters.
    assert cases["lean"] and cases["step_error"] < 1e-5


def test_one_update_moves_the_adapters_alone(cases):
    assert cases["applied"]
    assert cases["trainable"] and all(name.endswith(("lora_A", "lora_B")) for name in cases["trainable"])
    # B starts at zero, so A's first gradient is zero: the first update moves every B.
    assert cases["moved"] == {name for name in cases["trainable"] if name.endswith("lora_B")}


def test_checkpoint_holds_the_adapters_alone(cases):
    assert cases["reloaded"]
    assert "lora" in cases["refused_without_adapters"] and "train.load" in cases["refused_without_adapters"]


def test_base_fingerprint_tells_bases_apart(cases):
    assert cases["same_base"] and not cases["other_base"]
