"""The tiny model under context parallelism gives the one-process loss, gradients and parameters on
one packed row, in real gloo processes through Megatron's schedule, DDP and finalize_model_grads;
fp32, 1e-5. Each CP rank holds its zigzag share of the row; lightning layers exchange chunk states,
softmax layers all-gather K and V (or pass them round a ring: CP = 4 with context_parallel_comm = p2p).
Layouts: CP = 2, CP = 4 (chunks of 6 tokens, documents over 3+ chunks), CP x TP (TP = 2 with sequence parallelism: each rank's share split again along the
sequence), CP x EP and CP x PP (the stages pass [N / CP, 1, H] activations).

The row of 48 tokens holds documents of odd lengths and a trailing padding pseudo-document, laid so
that documents cross chunk and rank boundaries at CP = 2 (chunks of 12) and CP = 4. The loss is the
summed cross-entropy of each real token's next token within its document, through the model's
labels path (the vocab-parallel cross-entropy); the padding stays out of the MoE load-balancing
loss (on, 1e-3) through padding_mask; the routers replay recorded experts of the real tokens
(routing replay) and count their disagreement with them.

LoRA adapters at CP = 2 give the one-process results too.

Also: decoding under CP runs each rank's sequences whole (the one-process logits on every rank), a
CP forward without packed rows gets one error, and a checkpoint saved at CP = 2 loads at CP = 1 with
the same weights (CP ranks save their weights as replicas).
"""

from __future__ import annotations

import pytest
import torch

from megacispo.parallel.sharded import assemble
from megacispo.testing.harness import run_distributed
from megacispo.testing.parallel_case import assert_close_by_key

LENGTHS = (7, 3, 21, 9, 8)  # the last document is the row's padding
ROW_LEN = sum(LENGTHS)
PAD_ID = 0  # the real tokens are drawn from 1 .. V - 1
PROMPTS = torch.tensor([[0, 0, 5, 17, 9], [3, 8, 2, 44, 61]])  # left-padded, for prefill
PROMPT_MASK = PROMPTS != 0


def _packed_row(vocab_size: int, num_layers: int, num_experts: int) -> dict[str, torch.Tensor]:
    """The whole row: input_ids, labels, loss weights, padding mask [1, N], the recorded experts
    [1, N, layers, top-k] and cu_seqlens [D + 1]."""
    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(1, vocab_size, (1, ROW_LEN + 1), generator=generator)
    cu_seqlens = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    padding = torch.arange(ROW_LEN + 1) >= cu_seqlens[-2]
    tokens[:, padding] = PAD_ID
    last_of_document = torch.zeros(ROW_LEN, dtype=torch.bool)
    last_of_document[cu_seqlens[1:] - 1] = True
    experts = torch.randint(0, num_experts, (1, ROW_LEN, num_layers, 2), generator=generator)
    first, second = experts.unbind(-1)
    experts[..., 1] = torch.where(first == second, (second + 1) % num_experts, second)  # distinct top-k
    return dict(
        input_ids=tokens[:, :-1], labels=tokens[:, 1:], padding_mask=padding[None, :-1],
        weights=(~padding[:-1] & ~last_of_document).float()[None], experts=experts, cu_seqlens=cu_seqlens,
    )


def _train_step(
    layout: dict, load_dir: str | None = None, save_dir: str | None = None, recompute: str = "none",
    lora_rank: int = 0,
) -> dict:
    """One forward-backward of this rank's zigzag share of the row (all of it at CP = 1), run in each
    rank, with activation recompute of granularity ``recompute``. Returns the rank's loss (its
    tokens' sum; None off the last stage), whether it counts towards the row's loss (last stage, TP
    rank 0: TP ranks compute the same sum), its gradient and parameter pieces, its routers'
    disagreement counts, its decoding logits of PROMPTS, and the error of a forward without
    packed_seq_params (None at CP = 1). ``lora_rank``: LoRA adapters of that rank train, the base frozen."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megacispo.models.config import LoraConfig, RecomputeConfig
    from megacispo.models.routing import RoutingTargets
    from megacispo.parallel.context import zigzag_positions
    from megacispo.parallel.sharded import gradient_pieces, parameter_pieces
    from megacispo.testing.parallel_case import tiny_ddp_model

    lora = LoraConfig(rank=lora_rank) if lora_rank else None
    ddp_model, model_cfg, config = tiny_ddp_model(layout, load_dir, save_dir, lora=lora,
                                                  recompute=RecomputeConfig(granularity=recompute))
    model = ddp_model.module

    cp_size, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    row = _packed_row(model_cfg.vocab_size, model_cfg.num_layers, model_cfg.num_experts)
    positions = zigzag_positions(ROW_LEN, cp_size, cp_rank)
    local = {name: row[name][:, positions] for name in ("input_ids", "labels", "padding_mask", "weights", "experts")}
    first_layer = model.decoder.layers[0].layer_number - 1
    stage_layers = slice(first_layer, first_layer + len(model.decoder.layers))
    longest = max(LENGTHS)
    packed = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=row["cu_seqlens"], cu_seqlens_kv=row["cu_seqlens"], max_seqlen_q=longest,
        max_seqlen_kv=longest,
    )

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        losses = model(
            batch["input_ids"], None, None, labels=batch["labels"], packed_seq_params=packed,
            padding_mask=batch["padding_mask"],
            routing=RoutingTargets(
                experts=batch["experts"][:, :, stage_layers], recorded=~batch["padding_mask"],
                # A recomputed layer routes twice, and the trainer compares only in its no-grad pass.
                compare=~batch["padding_mask"] if recompute == "none" else None, replay=True,
            ),
        )

        def loss_func(per_token):
            loss = (per_token.float() * batch["weights"]).sum()
            # Cloned: the schedule scales the returned loss in place (by CP, then 1 / micro-batches).
            return loss, {"lm loss": loss.detach().clone()}

        return losses, loss_func

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([local]), model=[ddp_model], num_microbatches=1,
        seq_length=ROW_LEN, micro_batch_size=1,
    )
    last_stage = parallel_state.is_pipeline_last_stage()
    route_counts = model.take_route_counts()
    model.eval()
    logits, _ = model.prefill(PROMPTS, PROMPT_MASK)
    unpacked_error = None
    if cp_size > 1:
        try:
            model(local["input_ids"])
        except ValueError as error:
            unpacked_error = str(error)
    return {
        "loss": outputs[0]["lm loss"] if outputs else None,
        "counts": last_stage and parallel_state.get_tensor_model_parallel_rank() == 0,
        "route_counts": route_counts,
        "grads": gradient_pieces(ddp_model.module),
        "params": parameter_pieces(ddp_model.module),
        "prefill_logits": logits,
        "unpacked_error": unpacked_error,
    }


def _assert_matches_one_process(expected: dict, results: list[dict], name: str, compared: bool) -> None:
    """The row's loss (the sum of the ranks' sums), the routers' disagreement counts (summed over the
    ranks; none where the run did not compare), every gradient and every parameter of a
    context-parallel run equal the one-process run's; so do the decoding logits of every rank."""
    row_loss = torch.stack([r["loss"] for r in results if r["counts"]]).sum()
    torch.testing.assert_close(row_loss, expected["loss"], rtol=1e-5, atol=0)
    route_counts = torch.stack([r["route_counts"] for r in results]).sum(0)
    expected_counts = expected["route_counts"] if compared else torch.zeros_like(route_counts)
    assert expected["route_counts"][:, 1].min() > 0, "the reference compared no routes"
    assert torch.equal(route_counts, expected_counts), f"{name}: {route_counts} != {expected_counts}"
    assert_close_by_key(assemble([expected["grads"]]), assemble([r["grads"] for r in results]), f"{name} grad")
    params = assemble([r["params"] for r in results])
    assert_close_by_key(assemble([expected["params"]]), params, f"{name} param", rtol=0)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["prefill_logits"], expected["prefill_logits"], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, rank=rank: f"{name} rank {rank} prefill logits: {m}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The one-process run of the whole row; its weights seed every layout."""
    ckpt = str(tmp_path_factory.mktemp("cp_reference"))
    (result,) = run_distributed(_train_step, 1, {}, save_dir=ckpt)
    return result, ckpt


# name -> (layout, processes, recompute)
LAYOUTS = {
    "cp2": ({"context_parallel_size": 2}, 2, "none"),
    "cp4": ({"context_parallel_size": 4}, 4, "none"),
    # The softmax layers' K and V passed round a ring instead of all-gathered.
    "cp4_ring": ({"context_parallel_size": 4, "context_parallel_comm": "p2p"}, 4, "none"),
    "cp2_tp2_sp": (
        {"context_parallel_size": 2, "tensor_model_parallel_size": 2, "sequence_parallel": True}, 4, "none"
    ),
    "cp2_ep2": ({"context_parallel_size": 2, "expert_model_parallel_size": 2}, 2, "none"),
    "cp2_pp2": ({"context_parallel_size": 2, "pipeline_model_parallel_size": 2}, 4, "none"),
    # Every layer runs again in backward, its CP collectives with it.
    "cp2_full_recompute": ({"context_parallel_size": 2}, 2, "full"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_matches_one_process(reference, name):
    expected, ckpt = reference
    layout, processes, recompute = LAYOUTS[name]
    results = run_distributed(_train_step, processes, layout, load_dir=ckpt, recompute=recompute)
    _assert_matches_one_process(expected, results, name, compared=recompute == "none")
    cp_size = layout["context_parallel_size"]
    error = results[0]["unpacked_error"]
    assert error is not None and error.startswith(f"context_parallel_size = {cp_size}: a training forward takes")


def test_lora_under_context_parallelism_matches_one_process(tmp_path):
    """LoRA adapters (every target) at CP = 2: the adapters' gradients, as every other result."""
    (expected,) = run_distributed(_train_step, 1, {}, save_dir=str(tmp_path), lora_rank=4)
    results = run_distributed(_train_step, 2, {"context_parallel_size": 2}, load_dir=str(tmp_path), lora_rank=4)
    _assert_matches_one_process(expected, results, "cp2 lora", compared=True)
    assert any(key.endswith("lora_A") and grad.abs().max() > 0 for key, grad in assemble([expected["grads"]]).items())


def _save_at_cp2(root: str) -> list:
    from megacispo.checkpoint.distributed import save_checkpoint
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.parallel.sharded import parameter_pieces

    config, parallel = model_config("tiny"), ParallelConfig(context_parallel_size=2)
    init_distributed(parallel, seed=5)
    model = HybridModel(config, transformer_config(config, parallel))
    save_checkpoint(root, 1, model, keep_last=None)
    return parameter_pieces(model)


def _load_at_cp1(path: str) -> list:
    from megacispo.checkpoint.distributed import load_checkpoint
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.parallel.sharded import parameter_pieces

    config, parallel = model_config("tiny"), ParallelConfig()
    init_distributed(parallel, seed=0)
    model = HybridModel(config, transformer_config(config, parallel))
    load_checkpoint(path, model, load_rng=False)
    return parameter_pieces(model)


def test_checkpoint_saved_at_cp2_loads_at_cp1(tmp_path):
    saved = run_distributed(_save_at_cp2, 2, str(tmp_path))
    first, second = (assemble([pieces]) for pieces in saved)
    assert all(torch.equal(first[key], second[key]) for key in first), "CP ranks hold different weights"
    (loaded,) = run_distributed(_load_at_cp1, 1, str(tmp_path / "step_00000001"))
    loaded = assemble([loaded])
    assert loaded.keys() == first.keys()
    assert all(torch.equal(loaded[key], first[key]) for key in first)
