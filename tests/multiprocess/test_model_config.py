"""The model config: named sizes, the MiniMax-M1 parameter count, validation messages, layer kinds,
the Megatron config it maps to, and the HF config round trip (no processes, no weights)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megacispo.models import hf_names
from megacispo.models.config import (
    M2,
    MODEL_SIZES,
    RESIDUAL_FACTORS,
    deepnorm_alpha,
    model_config,
    model_shape,
    parameter_breakdown,
    parameter_counts,
    transformer_config,
)
from megacispo.parallel.layout import ParallelConfig, validate_layout

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(MODEL_SIZES))
def test_named_sizes_validate(name):
    config = model_config(name)
    config.validate()
    if config.family == M2:  # all softmax attention, the plain pre-norm residual
        assert config.layer_kinds == "S" * config.num_layers and config.prenorm_residual and config.qk_norm
        assert all(getattr(config, factor) == 1.0 for factor in RESIDUAL_FACTORS)
        return
    assert config.layer_kinds.count("S") >= 1 and config.layer_kinds.count("L") >= 1
    assert config.linear_attn_alpha_factor == pytest.approx(deepnorm_alpha(config.num_layers))


def test_small_and_tiny_sizes():
    tiny_total, _ = parameter_counts(model_config("tiny"))
    small_total, _ = parameter_counts(model_config("small"))
    assert 1e5 < tiny_total < 1e6
    assert 25e6 < small_total < 35e6


def test_minimax_m1_parameter_count():
    config = model_config("minimax-m1")
    total, activated = parameter_counts(config)
    assert round(total / 1e9, 1) == 456.1
    assert round(activated / 1e9, 1) == 45.9
    assert sum(parameter_breakdown(config).values()) == total
    assert config.linear_attn_alpha_factor == 3.5565588200778455
    assert config.layer_kinds == "LLLLLLLS" * 10
    assert [i for i, kind in enumerate(config.layer_kinds) if kind == "S"] == list(range(7, 80, 8))


def test_minimax_m2_parameter_count():
    """The published ~230B total and ~10B activated of MiniMax-M2 (62 layers, 256 experts, top 8)."""
    config = model_config("minimax-m2")
    total, activated = parameter_counts(config)
    assert round(total / 1e9, 1) == 228.7 and round(activated / 1e9, 1) == 9.8
    assert sum(parameter_breakdown(config).values()) == total
    assert parameter_breakdown(config)["lightning_attention"] == 0


def test_model_info_prints_the_counts():
    result = subprocess.run(
        [sys.executable, "tools/model_info.py", "--model", "minimax-m1"],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=120,
    )
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert "456.1B" in lines["total"]
    assert "45.9B" in lines["activated"]
    assert "experts" in lines and "lightning_attention" in lines


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"layer_pattern": "LLXS"}, "layer_pattern"),
        ({"layer_pattern": "LLS"}, "layer_pattern"),  # length 3 does not divide 8 layers
        ({"layer_pattern": ""}, "layer_pattern"),
        ({"num_query_groups": 3}, "num_query_groups"),
        ({"rotary_dim": 7}, "rotary_dim"),
        ({"rotary_dim": 32}, "rotary_dim"),  # wider than head_dim 16
        ({"moe_router_topk": 5}, "moe_router_topk"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"norm_eps": 0.0}, "norm_eps"),
        ({"moe_aux_loss_coeff": -1.0}, "moe_aux_loss_coeff"),
    ],
)
def test_bad_fields_raise_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        model_config("tiny", **changes)


def test_unknown_size_lists_the_sizes():
    with pytest.raises(ValueError, match="minimax-m1"):
        model_config("huge")


def test_layer_pattern_picks_mixers_and_residual_factors():
    config = model_config("tiny", layer_pattern="LS", full_attn_alpha_factor=5.0, linear_attn_beta_factor=0.5)
    assert config.layer_kinds == "LSLSLSLS"
    assert config.residual_factors(0) == (config.linear_attn_alpha_factor, 0.5, 2.0, 1.0)
    assert config.residual_factors(3) == (5.0, 1.0, 2.0, 1.0)
    # One character per layer is a pattern too.
    per_layer = model_config("tiny", layer_pattern="SLLLLLLS")
    assert per_layer.layer_kinds == "SLLLLLLS"


def test_layer_specs_follow_the_pattern():
    from megacispo.models.decoder_layer import layer_spec
    from megacispo.models.lightning_mixer import LightningMixer
    from megacispo.models.softmax_attention import SoftmaxAttention

    config = model_config("tiny", layer_pattern="LLS" + "L" * 5)
    mixers = [layer_spec(config, i).submodules.self_attention.module for i in range(config.num_layers)]
    assert mixers == [LightningMixer, LightningMixer, SoftmaxAttention] + [LightningMixer] * 5


def test_transformer_config_and_layout_shape():
    config = model_config("tiny")
    parallel = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    megatron = transformer_config(config, parallel)
    assert (megatron.num_layers, megatron.kv_channels, megatron.num_query_groups) == (8, 16, 2)
    assert megatron.num_moe_experts == 4 and megatron.moe_router_topk == 2
    assert megatron.moe_router_pre_softmax is False and megatron.moe_router_dtype == "fp32"
    assert megatron.gated_linear_unit and not megatron.add_bias_linear
    assert megatron.tensor_model_parallel_size == 2 and megatron.sequence_parallel
    assert transformer_config(config, ParallelConfig(), params_dtype=torch.bfloat16).bf16
    validate_layout(parallel, 2, model_shape(config))
    with pytest.raises(ValueError, match="num_query_groups"):
        validate_layout(ParallelConfig(tensor_model_parallel_size=4), 4, model_shape(config))


def test_hf_config_round_trip():
    config = model_config("minimax-m1")
    hf = hf_names.config_to_hf(config)
    assert hf["layer_types"][7] == "full_attention" and hf["layer_types"][6] == "linear_attention"
    assert hf["rope_parameters"]["rope_theta"] == 10_000_000.0
    back = hf_names.config_from_hf(hf)
    assert back.replace(fp32_lm_head=config.fp32_lm_head) == config
    # Without a recorded rotary_dim, HF semantics: RoPE over the whole head.
    del hf["rotary_dim"]
    assert hf_names.config_from_hf(hf).rotary_dim == config.head_dim


def test_hf_config_from_transformers_object():
    transformers = pytest.importorskip("transformers")
    hf = transformers.MiniMaxConfig(**hf_names.config_to_hf(model_config("tiny")))
    config = hf_names.config_from_hf(hf)
    assert config.layer_pattern == "LLLLLLLS" and config.rotary_dim == 8
    with pytest.raises(ValueError, match="layer_types"):
        hf_names.config_from_hf({**hf_names.config_to_hf(model_config("tiny")), "layer_types": ["moe"] * 8})
