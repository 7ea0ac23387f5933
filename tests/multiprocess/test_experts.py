"""SkipEmptySequentialMLP computes what Megatron's SequentialMLP computes, with the same parameters
and checkpoint keys: outputs, input gradients and weight gradients (zero for an idle expert) equal
to 1e-6 in fp32 on random permuted tokens, with experts that get no tokens, with and without
autograd. InProcessMoELayer's output equals Megatron's MoELayer's to 1e-6, with and without
autograd. Runs in a gloo world of one (the experts need Megatron's process groups)."""

from __future__ import annotations

import pytest
import torch

from megacispo.testing.harness import run_distributed

# Largest difference relative to the values' scale (at least 1): the two sides' products may take
# different kernels (parallel/cpu/csrc/cpu_gemm.cpp picks by the number of rows), the same sums in
# another order.
TOLERANCE = 1e-6
# Tokens per local expert of the tiny model (4 experts): idle experts first, in the middle and
# last, one expert with everything, and no tokens at all.
TOKEN_SPLITS = ((3, 0, 5, 1), (0, 0, 7, 0), (0, 2, 0, 0), (0, 0, 0, 0), (4, 6, 2, 9))


def _build_pair():
    """(SequentialMLP, SkipEmptySequentialMLP) of the tiny model's experts with the same weights."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.experts import SkipEmptySequentialMLP
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    model_cfg = model_config("tiny")
    parallel = ParallelConfig()
    init_distributed(parallel, seed=3)
    config = transformer_config(model_cfg, parallel)
    submodules = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    upstream = SequentialMLP(model_cfg.num_experts, config, submodules, pg_collection=pg_collection)
    ours = SkipEmptySequentialMLP(model_cfg.num_experts, config, submodules, pg_collection=pg_collection)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in upstream.parameters():
            param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    ours.load_state_dict(upstream.state_dict())
    return upstream, ours, config


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.clone() for name, p in module.named_parameters()}


def _max_difference(a: dict, b: dict) -> float:
    """The largest |a - b| over the tensors, each relative to max(|a|, 1)."""
    assert a.keys() == b.keys()
    worst = 0.0
    for key in a:
        assert (a[key] is None) == (b[key] is None), key
        if a[key] is not None:
            assert a[key].shape == b[key].shape, key
            if a[key].numel():
                scale = max(a[key].abs().max().item(), 1.0)
                worst = max(worst, (a[key] - b[key]).abs().max().item() / scale)
    return worst


def _describe(entry) -> tuple:
    """A sharded_state_dict entry: a ShardedTensor, a ShardedTensorFactory (the gated fc1 is split
    into [gate; up] on save) or a ShardedObject (the linears' extra state, no tensor)."""
    shape = tuple(entry.data.shape) if torch.is_tensor(entry.data) else None
    return type(entry).__name__, entry.key, shape, entry.replica_id


def _compare() -> dict:
    from megacispo.models.experts import supports_fused_forward

    upstream, ours, config = _build_pair()
    generator = torch.Generator().manual_seed(9)
    out = {"fused": supports_fused_forward(config), "cases": []}
    for split in TOKEN_SPLITS:
        num_tokens = sum(split)
        hidden = torch.randn(num_tokens, config.hidden_size, generator=generator)
        probs = torch.rand(num_tokens, generator=generator)
        tokens_per_expert = torch.tensor(split)
        output_weights = torch.randn(num_tokens, config.hidden_size, generator=generator)
        results = {}
        for name, module in (("upstream", upstream), ("ours", ours)):
            module.zero_grad(set_to_none=True)
            inputs = hidden.clone().requires_grad_(True)
            output, bias = module(inputs, tokens_per_expert, probs)
            (output * output_weights).sum().backward()
            with torch.no_grad():
                no_grad_output, _ = module(hidden, tokens_per_expert, probs)
            results[name] = {"output": output.detach(), "input_grad": inputs.grad, "no_grad_output": no_grad_output,
                             "bias": bias, "param_grads": _grads(module)}
        a, b = results["upstream"], results["ours"]
        out["cases"].append({
            "split": split,
            "shapes": (tuple(a["output"].shape), tuple(b["output"].shape), tuple(b["no_grad_output"].shape)),
            "bias": (a["bias"], b["bias"]),
            "output": _max_difference({"o": a["output"]}, {"o": b["output"]}),
            "no_grad_output": _max_difference({"o": a["output"]}, {"o": b["no_grad_output"]}),
            "input_grad": _max_difference({"g": a["input_grad"]}, {"g": b["input_grad"]}),
            "param_grads": _max_difference(a["param_grads"], b["param_grads"]),
            "idle_grads_zero": all(
                float(b["param_grads"][f"local_experts.{e}.{layer}.weight"].abs().max()) == 0.0
                for e, count in enumerate(split) if count == 0 for layer in ("linear_fc1", "linear_fc2")
            ),
        })
    sharded = {
        name: {key: _describe(entry) for key, entry in module.sharded_state_dict(prefix="mlp.experts.").items()}
        for name, module in (("upstream", upstream), ("ours", ours))
    }
    out["state_dict_keys"] = (list(upstream.state_dict()), list(ours.state_dict()))
    out["sharded"] = (sharded["upstream"], sharded["ours"])
    # expert_weights() was looked up by the forwards above; a cast keeps the Parameter objects.
    ours.double()
    fc1_weights, fc2_weights = ours.expert_weights()
    out["weights_after_cast"] = {
        "dtypes": {str(weight.dtype) for weight in fc1_weights + fc2_weights},
        "are_the_modules": all(
            fc1 is expert.linear_fc1.weight and fc2 is expert.linear_fc2.weight
            for fc1, fc2, expert in zip(fc1_weights, fc2_weights, ours.local_experts, strict=True)
        ),
    }
    return out


def _compare_moe_layers() -> dict:
    """Megatron's MoELayer (SequentialMLP experts) against local_moe_spec's InProcessMoELayer with the
    same weights, on random hidden states [s, b, H] in eval mode: without autograd (ours routes in
    process) and with it (ours runs Megatron's dispatcher)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import build_module

    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.decoder_layer import local_moe_spec
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    model_cfg = model_config("tiny")
    parallel = ParallelConfig()
    init_distributed(parallel, seed=3)
    config = transformer_config(model_cfg, parallel)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    upstream_spec = get_gpt_layer_local_spec(num_experts=model_cfg.num_experts, moe_grouped_gemm=False).submodules.mlp
    layers = {}
    for name, spec in (("upstream", upstream_spec), ("ours", local_moe_spec(model_cfg.num_experts))):
        layers[name] = build_module(spec, config=config, pg_collection=pg_collection)
        layers[name].set_layer_number(1)
        layers[name].eval()
    layers["ours"].load_state_dict(layers["upstream"].state_dict())
    generator = torch.Generator().manual_seed(13)
    differences = {"no_grad": 0.0, "grad": 0.0}
    for seq_len, batch in ((1, 1), (5, 3), (17, 2)):
        hidden = torch.randn(seq_len, batch, config.hidden_size, generator=generator)
        with torch.no_grad():
            expected, _ = layers["upstream"](hidden)
            actual, _ = layers["ours"](hidden)
        differences["no_grad"] = max(differences["no_grad"], (expected - actual).abs().max().item())
        expected, _ = layers["upstream"](hidden)
        actual, _ = layers["ours"](hidden)
        differences["grad"] = max(differences["grad"], (expected - actual).abs().max().item())
    return {"types": {name: type(layer).__name__ for name, layer in layers.items()}, "differences": differences,
            "state_dict_keys": (list(layers["upstream"].state_dict()), list(layers["ours"].state_dict()))}


@pytest.fixture(scope="module")
def comparison() -> dict:
    (result,) = run_distributed(_compare, 1)
    return result


def test_the_tiny_config_takes_the_fused_forward(comparison):
    assert comparison["fused"]


@pytest.mark.parametrize("case", range(len(TOKEN_SPLITS)))
def test_outputs_and_gradients_equal_sequential_mlp(comparison, case):
    result = comparison["cases"][case]
    num_tokens = sum(result["split"])
    assert all(shape[0] == num_tokens for shape in result["shapes"]), result["shapes"]
    assert result["bias"] == (None, None)
    for key in ("output", "no_grad_output", "input_grad", "param_grads"):
        assert result[key] <= TOLERANCE, (result["split"], key, result[key])
    assert result["idle_grads_zero"]


def test_expert_weights_are_the_modules_parameters_after_a_cast(comparison):
    assert comparison["weights_after_cast"] == {"dtypes": {"torch.float64"}, "are_the_modules": True}


def test_state_dict_and_sharded_keys_equal_sequential_mlp(comparison):
    upstream_keys, our_keys = comparison["state_dict_keys"]
    assert our_keys == upstream_keys
    upstream_sharded, our_sharded = comparison["sharded"]
    assert our_sharded == upstream_sharded
    assert any(".experts.linear_fc1.weight" in key for _, key, _, _ in our_sharded.values())


def test_in_process_moe_layer_equals_megatrons_moe_layer():
    (result,) = run_distributed(_compare_moe_layers, 1)
    assert result["types"] == {"upstream": "MoELayer", "ours": "InProcessMoELayer"}
    assert result["state_dict_keys"][0] == result["state_dict_keys"][1]
    for mode, difference in result["differences"].items():
        assert difference <= TOLERANCE, (mode, difference)


def test_local_moe_spec_uses_skip_empty_experts():
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megacispo.models.decoder_layer import local_moe_spec
    from megacispo.models.experts import InProcessMoELayer, SkipEmptySequentialMLP

    spec = local_moe_spec(4)
    assert spec.module is InProcessMoELayer
    experts = spec.submodules.experts
    assert experts.module is SkipEmptySequentialMLP
    assert issubclass(experts.module, SequentialMLP)
