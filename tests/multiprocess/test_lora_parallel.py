"""LoRA adapters under every parallel layout give the single-process loss and adapter gradients (the
tiny model, same seed, data and weights: the reference saves a dist checkpoint, adapters included, that
each layout loads), in real gloo processes through Megatron's schedules, DDP and finalize_model_grads;
fp32, 1e-5. TP 2 (with sequence parallelism, and the experts at expert-TP 2) splits the column-parallel
adapters' B and the row-parallel adapters' A; EP 2 places each expert's adapters with the expert; PP 2
splits the layers. The base is frozen: it has no gradient."""

from __future__ import annotations

import pytest
import torch

from megacispo.models.config import LoraConfig
from megacispo.parallel.sharded import assemble
from megacispo.testing.harness import run_distributed
from megacispo.testing.parallel_case import assert_close_by_key, forward_backward, global_loss, tiny_ddp_model

SEQ_LEN = 32
GLOBAL_BATCH = 4
NUM_MICROBATCHES = 2
LORA = LoraConfig(rank=4, alpha=8.0)


def _train_step(layout: dict, num_microbatches: int, load_dir: str | None = None, save_dir: str | None = None):
    model, model_cfg, _ = tiny_ddp_model(layout, load_dir, save_dir, lora=LORA)
    frozen_with_grads = [name for name, param in model.module.named_parameters()
                         if not name.endswith(("lora_A", "lora_B")) and (param.requires_grad or param.grad is not None)]
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, model_cfg.vocab_size, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)
    result = forward_backward(model, tokens, num_microbatches,
                              lambda model, batch: model(batch[:, :-1], None, None, labels=batch[:, 1:]))
    result["frozen_with_grads"] = frozen_with_grads
    return result


def _adapters(pieces_by_rank) -> dict[str, torch.Tensor]:
    return {key: value for key, value in assemble(pieces_by_rank).items() if key.endswith(("lora_A", "lora_B"))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ref_lora")
    (result,) = run_distributed(_train_step, 1, {}, NUM_MICROBATCHES, save_dir=str(ckpt))
    return result, str(ckpt)


def test_reference_trains_every_adapter_and_nothing_else(reference):
    expected, _ = reference
    assert expected["frozen_with_grads"] == []
    grads = _adapters([expected["grads"]])
    kinds = {key.rsplit(".", 2)[-2] for key in grads}
    assert kinds == {"qkv_proj", "output_gate", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                     "linear_fc1", "linear_fc2"}
    assert [key for key, grad in grads.items() if grad.abs().max() == 0] == []


LAYOUTS = {
    "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2": {"pipeline_model_parallel_size": 2},
    "ep2": {"expert_model_parallel_size": 2},
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_layout_matches_single_process(reference, name):
    expected, ckpt = reference
    layout = LAYOUTS[name]
    dp_size = 2 // layout.get("tensor_model_parallel_size", 1) // layout.get("pipeline_model_parallel_size", 1)
    results = run_distributed(_train_step, 2, layout, NUM_MICROBATCHES // dp_size, load_dir=ckpt)
    torch.testing.assert_close(global_loss(results), expected["loss"], rtol=1e-5, atol=0)
    assert_close_by_key(_adapters([expected["grads"]]), _adapters([r["grads"] for r in results]), f"{name} grad")
