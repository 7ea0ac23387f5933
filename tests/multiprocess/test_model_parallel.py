"""The tiny hybrid model under every parallel layout gives the single-process loss and gradients
(same seed, data and weights: the reference saves a dist checkpoint that each layout loads), in
real gloo processes, through Megatron's schedules, DDP and finalize_model_grads; fp32, 1e-5. The
rows are right-padded to different lengths, and ``padding_mask`` keeps the padding out of the MoE
load-balancing loss: each layout must split it as it splits the tokens (sequence parallelism gives
each rank its slice of it).

Tensor parallelism is tested with sequence parallelism: Megatron-Core's MoELayer refuses to train
with TP > 1 without it (moe_layer.py:379 raises ValueError). TP = 2 without sequence parallelism
runs in inference, where tests/test_model_decoding.py checks it.
"""

from __future__ import annotations

import pytest
import torch

from megacispo.parallel.sharded import assemble
from megacispo.testing.harness import run_distributed
from megacispo.testing.parallel_case import assert_close_by_key, forward_backward, global_loss, tiny_ddp_model

SEQ_LEN = 32  # two lightning blocks of the tiny model
GLOBAL_BATCH = 8
NUM_MICROBATCHES = 4  # of the single-process reference; fewer per rank under data parallelism
PAD_ID = 0  # the real tokens are drawn from 1 .. V - 1


def _train_step(layout: dict, num_microbatches: int, load_dir: str | None = None, save_dir: str | None = None):
    """One forward-backward of the tiny model over the fixed global batch, run in each rank."""
    model, model_cfg, _ = tiny_ddp_model(layout, load_dir, save_dir)

    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, model_cfg.vocab_size, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)
    lengths = SEQ_LEN + 1 - 3 * torch.arange(GLOBAL_BATCH)  # [b]: 33 down to 12 real tokens
    tokens[torch.arange(SEQ_LEN + 1) >= lengths[:, None]] = PAD_ID
    return forward_backward(
        model, tokens, num_microbatches,
        lambda model, batch: model(batch[:, :-1], None, None, labels=batch[:, 1:], padding_mask=batch[:, :-1] == PAD_ID),
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single-process run; its weights seed every layout."""
    ckpt = tmp_path_factory.mktemp("ref_hybrid")
    (result,) = run_distributed(_train_step, 1, {}, NUM_MICROBATCHES, save_dir=str(ckpt))
    return result, str(ckpt)


LAYOUTS = {
    "tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "pp2": {"pipeline_model_parallel_size": 2},
    "ep2": {"expert_model_parallel_size": 2},
}


def test_reference_gradients_reach_every_parameter(reference):
    expected, _ = reference
    grads = assemble([expected["grads"]])
    assert any(".self_attention.qkv_proj." in key for key in grads) and any(".q_proj." in key for key in grads)
    silent = [key for key, grad in grads.items() if grad.abs().max() == 0 and not key.endswith("_extra_state")]
    assert silent == []


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(reference, name):
    expected, ckpt = reference
    layout = LAYOUTS[name]
    world_size = 2
    dp_size = world_size // layout.get("tensor_model_parallel_size", 1) // layout.get("pipeline_model_parallel_size", 1)
    results = run_distributed(_train_step, world_size, layout, NUM_MICROBATCHES // dp_size, load_dir=ckpt)
    torch.testing.assert_close(global_loss(results), expected["loss"], rtol=1e-5, atol=0)
    assert_close_by_key(assemble([expected["grads"]]), assemble([r["grads"] for r in results]), f"{name} grad")
    assert_close_by_key(assemble([expected["params"]]), assemble([r["params"] for r in results]), f"{name} param", rtol=0)
