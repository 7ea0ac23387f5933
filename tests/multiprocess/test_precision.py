"""Precision and recompute switches: the config's checks and messages, the start-up error without
Transformer Engine, which modules the layer specs name with Transformer Engine on and off (checked
without importing it), the TransformerConfig fields they become, a bf16-weight training step, and
full recompute giving the same loss and gradients as none (fp32, real Megatron modules, one process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megacispo.models import te_specs
from megacispo.models.config import (
    DEFAULT_FP8_FORMAT,
    FP8_RECIPES,
    PrecisionConfig,
    RecomputeConfig,
    model_config,
    precision_kwargs,
    recompute_kwargs,
)
from megacispo.startup import run_config
from megacispo.testing.harness import run_distributed

REPO_ROOT = Path(__file__).resolve().parents[2]
TE_MISSING = not te_specs.transformer_engine_installed()
BF16_FP8 = ["precision.params_dtype=bfloat16", "precision.fp8=delayed"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["precision.params_dtype=float16"], "precision.params_dtype = 'float16': choose one of float32, bfloat16"),
        (["precision.fp8=delayed"],
         "precision.fp8 = 'delayed' with precision.params_dtype = 'float32': FP8 GEMMs take bf16 weights and "
         "activations; set precision.params_dtype = bfloat16"),
        (["precision.params_dtype=bfloat16", "precision.fp8=current"],
         "precision.fp8 = 'current': choose one of delayed, tensorwise, blockwise, mxfp8 (tensorwise is current "
         "scaling)"),
        ([*BF16_FP8, "precision.fp8_format=e5m2"], "precision.fp8_format = 'e5m2': choose one of hybrid, e4m3"),
        ([*BF16_FP8, "precision.fp8_margin=-1"], "precision.fp8_margin = -1: it must be >= 0"),
        ([*BF16_FP8, "precision.fp8_amax_history_len=0"], "precision.fp8_amax_history_len = 0: it must be >= 1"),
        ([*BF16_FP8, "precision.fp8_amax_compute_algo=mean"], "precision.fp8_amax_compute_algo = 'mean'"),
        (["precision.fp32_matmul=bf16"], "precision.fp32_matmul = 'bf16': choose one of ieee, tf32"),
        (["recompute.granularity=partial"], "recompute.granularity = 'partial': choose one of none, selective, full"),
        (["recompute.granularity=full", "recompute.method=chunked"], "recompute.method = 'chunked': choose one of"),
        (["recompute.granularity=full", "recompute.num_layers=2"],
         "recompute.num_layers = 2 with recompute.method = 'uniform': hybrid layers are recomputed one at a time"),
        (["recompute.granularity=full", "recompute.method=block", "recompute.num_layers=0"],
         "recompute.num_layers = 0: it must be at least 1"),
        # tiny: 8 layers over 2 pipeline stages.
        (["recompute.granularity=full", "recompute.method=block", "recompute.num_layers=5",
          "parallel.pipeline_model_parallel_size=2"],
         "recompute.num_layers = 5 exceeds the 4 layers of a pipeline stage (model.num_layers 8 / "
         "pipeline_model_parallel_size 2): choose at most 4"),
        (["recompute.granularity=selective", "recompute.modules=[core_attn]"],
         "recompute.modules = ['core_attn']: choose a non-empty list of moe, moe_act"),
        (["recompute.granularity=selective", "recompute.modules=[moe_act]"],
         "recompute.modules has moe_act, which only Transformer Engine's grouped experts honour"),
        ([*BF16_FP8, "recompute.granularity=selective", "recompute.modules=[moe_act]"],
         "recompute.modules has moe_act with precision.fp8 = 'delayed'"),
    ],
)
def test_bad_switches_name_the_field_the_value_and_the_fix(overrides, message):
    with pytest.raises(ValueError) as error:
        run_config(None, overrides)
    assert message in str(error.value)


def test_good_switches_load():
    config = run_config(None, [*BF16_FP8, "precision.fp8_margin=1", "recompute.granularity=full",
                                "recompute.method=block", "recompute.num_layers=8"])
    assert config.precision.torch_dtype == torch.bfloat16 and config.precision.transformer_engine
    assert (config.recompute.method, config.recompute.num_layers) == ("block", 8)
    defaults = run_config(None)
    assert defaults.precision.fp8 is None and not defaults.precision.transformer_engine
    assert defaults.precision.params_dtype == "float32" and defaults.recompute.granularity == "none"


def _fp32_matmul_precision(fp32_matmul: str) -> str:
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(), seed=0, fp32_matmul=fp32_matmul)
    return torch.get_float32_matmul_precision()


def test_the_fp32_matmul_precision_is_set_at_start_up():
    """precision.fp32_matmul reaches torch in every process (init_distributed), not left to its default."""
    from megacispo.testing.harness import run_distributed

    assert run_config(None).precision.fp32_matmul == "ieee"
    assert run_distributed(_fp32_matmul_precision, 2, "tf32") == ["high", "high"]
    assert run_distributed(_fp32_matmul_precision, 1, "ieee") == ["highest"]


def _entry_point(*args: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, "-m", "megacispo.train", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not TE_MISSING, reason="Transformer Engine is installed here")
def test_fp8_without_transformer_engine_fails_at_start_up_with_the_install_command(tmp_path):
    result = _entry_point("--set", "precision.params_dtype=bfloat16", "--set", "precision.fp8=blockwise",
                          "--set", f"train.run_dir={tmp_path / 'run'}")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: precision.fp8 = 'blockwise' needs Transformer Engine, which is not installed: " + te_specs.INSTALL_HINT)
    assert not (tmp_path / "run").exists()
    # The dry run plans the GPU run and names what this machine lacks.
    dry = _entry_point("--set", "precision.params_dtype=bfloat16", "--set", "precision.fp8=tensorwise", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert ("precision: bfloat16 weights, FP8 GEMMs (tensorwise scaling) through Transformer Engine "
            f"[Transformer Engine is not installed here: {te_specs.INSTALL_HINT}], LM head fp32") in dry.stdout


def test_fp8_recipes_check_the_installed_transformer_engine_version(monkeypatch):
    monkeypatch.setattr(te_specs, "transformer_engine_installed", lambda: True)
    monkeypatch.setattr(te_specs, "transformer_engine_version", lambda: "2.2.0")
    with pytest.raises(ValueError, match=r"precision.fp8 = 'blockwise' needs transformer-engine >= 2.3.0.dev0, "
                                         r"but 2.2.0 is installed"):
        te_specs.require_transformer_engine("blockwise")
    te_specs.require_transformer_engine(None)  # TE layers without FP8: any version
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="FP8 GEMMs need a CUDA GPU"):
            te_specs.require_transformer_engine("tensorwise")


def _tiny_transformer_config(precision: PrecisionConfig | None = None, recompute: RecomputeConfig | None = None,
                             pipeline: int = 1):
    from megacispo.models.config import transformer_config
    from megacispo.parallel.layout import ParallelConfig

    return transformer_config(model_config("tiny"), ParallelConfig(pipeline_model_parallel_size=pipeline),
                              precision=precision, recompute=recompute)


def test_spec_selection_local_and_transformer_engine():
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.router import TopKRouter

    from megacispo.models.decoder_layer import LOCAL_BACKEND, TRANSFORMER_ENGINE_BACKEND, block_spec, layer_backend
    from megacispo.models.experts import (
        InProcessMoELayer,
        PaddingMaskedTopKRouter,
        SkipEmptySequentialMLP,
        StackingTEGroupedMLP,
    )
    from megacispo.models.layers import (
        RMSNorm,
        TensorParallelRMSNorm,
        local_column_parallel_linear,
        row_parallel_linear,
    )
    from megacispo.models.lightning_mixer import LightningMixer
    from megacispo.models.softmax_attention import SoftmaxAttention

    tiny = model_config("tiny", layer_pattern="LLLS")
    local = _tiny_transformer_config()
    te = _tiny_transformer_config(PrecisionConfig(params_dtype="bfloat16", use_transformer_engine=True))
    assert layer_backend(local) is LOCAL_BACKEND and layer_backend(te) is TRANSFORMER_ENGINE_BACKEND
    extension = "megatron.core.extensions.transformer_engine"
    expected_linears = {
        "local": (local_column_parallel_linear, row_parallel_linear),
        "te": (te_specs.te_column_parallel_linear, te_specs.te_row_parallel_linear),
    }
    for name, config in (("local", local), ("te", te)):
        column, row = expected_linears[name]
        spec = block_spec(tiny, config, pp_rank=0)
        assert spec.layer_norm is RMSNorm
        for layer_idx, layer in enumerate(spec.layer_specs):
            parts = layer.submodules
            assert parts.input_layernorm is RMSNorm and parts.pre_mlp_layernorm is RMSNorm  # never FP8
            mixer = parts.self_attention
            assert mixer.module is (SoftmaxAttention if layer_idx % 4 == 3 else LightningMixer)
            projections = vars(mixer.submodules)
            norms = ("norm", "q_norm", "k_norm")
            columns = {key: value for key, value in projections.items() if key not in ("out_proj", "o_proj", *norms)}
            assert set(columns.values()) == {column}, (name, layer_idx, columns)
            assert projections.get("out_proj", projections.get("o_proj")) is row
            moe = parts.mlp
            # The router stays fp32 (Megatron's TopKRouter, its selection-bias counts fixed).
            assert moe.module is InProcessMoELayer and moe.submodules.router is PaddingMaskedTopKRouter
            assert issubclass(PaddingMaskedTopKRouter, TopKRouter)
            experts = moe.submodules.experts
            if name == "local":
                assert experts.module is SkipEmptySequentialMLP
                assert (experts.submodules.linear_fc1, experts.submodules.linear_fc2) == (ColumnParallelLinear,
                                                                                          RowParallelLinear)
            else:
                assert experts.module is StackingTEGroupedMLP and issubclass(StackingTEGroupedMLP, TEGroupedMLP)
                assert experts.submodules.linear_fc1.module == (extension, "TEColumnParallelGroupedLinear")
                assert experts.submodules.linear_fc2.module == (extension, "TERowParallelGroupedLinear")
        # MiniMax-M2's QK-norms are this project's norms on either backend: never FP8, never TE's.
        m2_mixer = block_spec(model_config("tiny-m2"), config, pp_rank=0).layer_specs[0].submodules.self_attention
        assert m2_mixer.module is SoftmaxAttention and m2_mixer.submodules.o_proj is row
        assert m2_mixer.submodules.q_norm is TensorParallelRMSNorm is m2_mixer.submodules.k_norm
    assert not [module for module in sys.modules if module.split(".")[0] == "transformer_engine"]


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_precision_becomes_megatron_fp8_fields(recipe):
    kwargs = precision_kwargs(PrecisionConfig(params_dtype="bfloat16", fp8=recipe, fp8_margin=2,
                                              fp8_amax_history_len=16))
    assert kwargs["fp8_recipe"] == recipe and kwargs["fp8"] == DEFAULT_FP8_FORMAT[recipe]
    assert (kwargs["fp8_margin"], kwargs["fp8_amax_history_len"], kwargs["fp8_amax_compute_algo"]) == (2, 16, "max")
    assert kwargs["bf16"] and kwargs["params_dtype"] == torch.bfloat16 == kwargs["pipeline_dtype"]
    assert kwargs["transformer_impl"] == "transformer_engine" and kwargs["moe_grouped_gemm"]
    explicit = precision_kwargs(PrecisionConfig(params_dtype="bfloat16", fp8=recipe, fp8_format="e4m3"))
    assert explicit["fp8"] == "e4m3"
    assert "fp8" not in precision_kwargs(PrecisionConfig(params_dtype="bfloat16"))


def test_transformer_config_gets_bf16_and_recompute_fields():
    from megacispo.models.decoder_layer import recomputes_layer

    config = _tiny_transformer_config(PrecisionConfig(params_dtype="bfloat16"),
                                      RecomputeConfig(granularity="full", method="block", num_layers=3), pipeline=2)
    assert config.bf16 and config.params_dtype == torch.bfloat16 and config.transformer_impl == "local"
    assert not config.moe_grouped_gemm and config.fp8 is None
    # Megatron's own block-level full recompute stays off: the hybrid layers checkpoint themselves.
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == (None, "block", 3)
    assert [recomputes_layer(config, i) for i in range(4)] == [True, True, True, False]
    uniform = _tiny_transformer_config(recompute=RecomputeConfig(granularity="full"))
    assert all(recomputes_layer(uniform, i) for i in range(8)) and not uniform.bf16
    selective = _tiny_transformer_config(recompute=RecomputeConfig(granularity="selective"))
    assert (selective.recompute_granularity, selective.recompute_modules) == ("selective", ["moe"])
    assert not any(recomputes_layer(selective, i) for i in range(8))
    assert recompute_kwargs(RecomputeConfig()) == {}
    assert not recomputes_layer(_tiny_transformer_config(), 0)


CLIP_GRAD = 1e-3


def _bf16_engine_step() -> dict:
    """One optimizer step of the tiny model with bf16 weights through the Engine (DDP, optimizer)."""
    from megacispo.startup import run_config
    from megacispo.training.engine import Engine

    config = run_config(None, ["precision.params_dtype=bfloat16", "optimizer.use_distributed_optimizer=false",
                                f"optimizer.clip_grad={CLIP_GRAD}"])
    engine = Engine(config, total_steps=1, peak_lr=1e-2)
    tokens = torch.randint(0, config.model.vocab_size, (4, 33), generator=torch.Generator().manual_seed(3))
    before = {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}

    def forward_step(batch, model):
        per_token = model(batch.tokens[:, :-1], labels=batch.tokens[:, 1:])
        return per_token, lambda output: (output.float().mean(), {"loss": output.detach().float().mean()})

    outputs = engine.run_micro_batches([SimpleNamespace(tokens=tokens)], forward_step, forward_only=False)
    result = engine.step()
    return {
        # The gradients the update used, after clipping (they stay until the next zero_grad).
        "clipped_grad_norm": engine.optimizer.get_grad_norm(),
        "loss": outputs[0]["loss"].item(),
        "applied": result.applied,
        "grad_norm": result.grad_norm,
        "dtypes": {p.dtype for p in engine.module.parameters()},
        "changed": sum(not torch.equal(before[name], p.detach().float())
                       for name, p in engine.module.named_parameters()),
        "num_params": len(before),
    }


def _training_runs() -> dict:
    """Both training checks in one process (each process start imports Megatron-Core)."""
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(), seed=11)
    return {"bf16": _bf16_engine_step(), "recompute": _recompute_cases()}


@pytest.fixture(scope="module")
def training_runs() -> dict:
    (result,) = run_distributed(_training_runs, 1)
    return result


def test_bf16_weights_train_one_step(training_runs):
    result = training_runs["bf16"]
    assert result["dtypes"] == {torch.bfloat16}
    assert torch.isfinite(torch.tensor(result["loss"])) and abs(result["loss"] - torch.log(torch.tensor(512.0))) < 1.0
    assert result["applied"] and CLIP_GRAD < result["grad_norm"] < float("inf")
    assert result["clipped_grad_norm"] == pytest.approx(CLIP_GRAD, rel=1e-4)
    # Every weight moved (the router's and the experts' too: lr 1e-2 is far above bf16's resolution).
    assert result["changed"] == result["num_params"]


def _loss_and_grads(model) -> dict:
    """Loss, gradients and per-layer mixer call counts of one forward-backward, padding and packed
    documents included."""
    from megatron.core.packed_seq_params import PackedSeqParams

    calls = [0] * len(model.decoder.layers)
    for index, layer in enumerate(model.decoder.layers):
        layer.self_attention.register_forward_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
    tokens = torch.randint(0, 512, (3, 38), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(3, 37, dtype=torch.bool)
    mask[1, 30:] = False  # right padding in one row
    loss = (model(tokens[:, :-1], attention_mask=mask, labels=tokens[:, 1:]) * mask).sum() / mask.sum()
    cu_seqlens = torch.tensor([0, 11, 37], dtype=torch.int32)
    packed = PackedSeqParams(cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, qkv_format="thd")
    loss = loss + model(tokens[:1, :-1], labels=tokens[:1, 1:], packed_seq_params=packed).mean()
    loss.backward()
    return {
        "loss": loss.detach(),
        "grads": {name: p.grad.clone() for name, p in model.named_parameters()},
        "calls": calls,
    }


def _recompute_cases() -> list[dict]:
    """The tiny model (fp32) without recompute, with full uniform and with full block (3 layers)
    recompute: same weights, same data."""
    from megacispo.models.model import HybridModel

    results, weights = [], None
    for recompute in (RecomputeConfig(), RecomputeConfig(granularity="full"),
                      RecomputeConfig(granularity="full", method="block", num_layers=3)):
        model = HybridModel(model_config("tiny"), _tiny_transformer_config(recompute=recompute)).train()
        weights = weights or model.state_dict()
        model.load_state_dict(weights)
        results.append(_loss_and_grads(model))
    return results


def test_full_recompute_gives_the_same_loss_and_gradients(training_runs):
    plain, uniform, block = training_runs["recompute"]
    # Two forwards per step (padded, packed); a recomputed layer runs each once more in backward.
    assert plain["calls"] == [2] * 8
    assert uniform["calls"] == [4] * 8
    assert block["calls"] == [4, 4, 4] + [2] * 5
    for recomputed in (uniform, block):
        torch.testing.assert_close(recomputed["loss"], plain["loss"], rtol=1e-6, atol=0)
        assert recomputed["grads"].keys() == plain["grads"].keys()
        for name, grad in plain["grads"].items():
            torch.testing.assert_close(recomputed["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)
