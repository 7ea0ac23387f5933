"""Megatron-Core's own GPTModel on the CPU back-end: every parallel layout gives the single-process
loss and gradients (same seed, same data, same weights), in real gloo processes."""

from __future__ import annotations

import pytest
import torch

from megacispo.parallel.sharded import assemble
from megacispo.testing.harness import run_distributed
from megacispo.testing.parallel_case import assert_close_by_key, forward_backward, global_loss

SEQ_LEN = 16
VOCAB = 128
GLOBAL_BATCH = 8


def _gpt_step(layout: dict, num_experts: int | None, num_microbatches: int, load_dir=None, save_dir=None):
    """One forward-backward of a tiny GPTModel over the fixed global batch, run in each rank."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from megacispo.parallel.layout import ParallelConfig, init_distributed

    parallel = ParallelConfig(**layout)
    init_distributed(parallel, seed=1234)
    moe = dict(num_moe_experts=num_experts, moe_router_topk=2, moe_aux_loss_coeff=1e-3,
               moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32") if num_experts else {}
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        use_cpu_initialization=True, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, **moe,
    )
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts),
        vocab_size=VOCAB, max_sequence_length=SEQ_LEN,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
    )
    if load_dir is not None:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), load_dir))
    if save_dir is not None:
        dist_checkpointing.save(model.sharded_state_dict(), save_dir)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    config.finalize_model_grads_func = finalize_model_grads

    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(7))
    position_ids = torch.arange(SEQ_LEN).unsqueeze(0)
    return forward_backward(
        model, tokens, num_microbatches, lambda model, batch: model(batch[:, :-1], position_ids, None, labels=batch[:, 1:]))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process runs of the dense and the MoE model; their weights seed every layout."""
    out = {}
    for name, experts in (("dense", None), ("moe", 4)):
        ckpt = tmp_path_factory.mktemp(f"ref_{name}")
        (result,) = run_distributed(_gpt_step, 1, {}, experts, 4, save_dir=str(ckpt))
        out[name] = (result, str(ckpt))
    return out


LAYOUTS = {
    "tp2": (2, {"tensor_model_parallel_size": 2}, "dense"),
    "pp2": (2, {"pipeline_model_parallel_size": 2}, "dense"),
    "ep2": (2, {"expert_model_parallel_size": 2}, "moe"),
    "tp2_dp2": (4, {"tensor_model_parallel_size": 2}, "dense"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(reference, name):
    world_size, layout, model_kind = LAYOUTS[name]
    (expected, ckpt) = reference[model_kind]
    experts = 4 if model_kind == "moe" else None
    dp_size = world_size // layout.get("tensor_model_parallel_size", 1) // layout.get("pipeline_model_parallel_size", 1)
    results = run_distributed(_gpt_step, world_size, layout, experts, 4 // dp_size, load_dir=ckpt)
    torch.testing.assert_close(global_loss(results), expected["loss"], rtol=1e-5, atol=0)
    assert_close_by_key(assemble([expected["grads"]]), assemble([r["grads"] for r in results]), f"{name} grad")


def test_checkpoint_saved_at_tp2_loads_at_tp1(reference, tmp_path):
    expected, ckpt = reference["dense"]
    tp2_ckpt = tmp_path / "tp2"
    tp2_ckpt.mkdir()
    run_distributed(_gpt_step, 2, {"tensor_model_parallel_size": 2}, None, 4, load_dir=ckpt, save_dir=str(tp2_ckpt))
    (reloaded,) = run_distributed(_gpt_step, 1, {}, None, 4, load_dir=str(tp2_ckpt))
    torch.testing.assert_close(reloaded["loss"], expected["loss"], rtol=1e-6, atol=0)
    assert_close_by_key(assemble([expected["params"]]), assemble([reloaded["params"]]), "param", rtol=0)
