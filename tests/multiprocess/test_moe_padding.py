"""Padding stays out of the MoE routers' load-balancing statistics: with ``padding_mask`` the
aux loss Megatron's router computes (its logged value, per layer) equals Switch's formula
E / (k T^2) * sum_e count_e * sum_t p_te over the real tokens alone (T of them), and the
trainer's expert-load counts hold k per real token; a mask of the wrong shape is refused. Runs
the tiny model in a gloo world of one; tests/test_model_parallel.py checks the padded batch under
TP + SP, PP and EP."""

from __future__ import annotations

import pytest
import torch

from megacispo.testing.harness import run_distributed

LENGTHS = (16, 11, 5)  # real tokens of each row; the rest of the 16 is padding


def _padded_forward():
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker, get_moe_layer_wise_logging_tracker

    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.rl.trainer import ExpertLoadTracker

    model_cfg = model_config("tiny")
    init_distributed(ParallelConfig(), seed=11)
    model = HybridModel(model_cfg, transformer_config(model_cfg, ParallelConfig()))
    model.train()
    generator = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, model_cfg.vocab_size, (len(LENGTHS), 16), generator=generator)
    padding_mask = torch.arange(16) >= torch.tensor(LENGTHS)[:, None]
    router_inputs = {}
    for layer in model.decoder.layers:
        layer.mlp.router.register_forward_pre_hook(
            lambda module, inputs, index=layer.layer_number - 1: router_inputs.__setitem__(index, inputs[0].detach()))
    load = ExpertLoadTracker(model, model_cfg.num_layers, model_cfg.num_experts)

    def logged_aux_losses(mask):
        clear_aux_losses_tracker()
        model(tokens, padding_mask=mask)
        return get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"].clone()

    try:
        model(tokens, padding_mask=padding_mask[:, :-1])
        bad_mask_error = None
    except ValueError as error:
        bad_mask_error = str(error)
    unmasked = logged_aux_losses(None)
    load.counts.zero_()
    masked = logged_aux_losses(padding_mask)
    weights = [layer.mlp.router.weight.detach().clone() for layer in model.decoder.layers]
    return {"masked": masked, "unmasked": unmasked, "counts": load.counts.clone(), "weights": weights,
            "inputs": [router_inputs[i] for i in range(len(weights))], "padding_mask": padding_mask,
            "topk": model_cfg.moe_router_topk, "bad_mask_error": bad_mask_error}


def _switch_loss(hidden: torch.Tensor, weight: torch.Tensor, real: torch.Tensor, topk: int) -> torch.Tensor:
    """hidden [s, b, H] of the router; real [s * b] bool. Switch's loss over the real tokens, fp64."""
    logits = hidden.reshape(-1, hidden.shape[-1]).double() @ weight.double().T  # [s * b, E]
    scores = torch.softmax(logits[real], dim=-1)
    counts = torch.zeros_like(scores).scatter_(1, scores.topk(topk, dim=-1).indices, 1.0).sum(dim=0)
    num_experts, num_tokens = scores.shape[1], scores.shape[0]
    return num_experts / (topk * num_tokens**2) * (counts * scores.sum(dim=0)).sum()


@pytest.fixture(scope="module")
def result():
    (result,) = run_distributed(_padded_forward, 1)
    return result


def test_padding_stays_out_of_the_load_balancing_loss(result):
    real = ~result["padding_mask"].T.reshape(-1)  # the router's tokens are in [s, b] order
    expected = torch.stack([
        _switch_loss(hidden, weight, real, result["topk"]) for hidden, weight in zip(result["inputs"], result["weights"])
    ])
    torch.testing.assert_close(result["masked"].double(), expected, rtol=1e-5, atol=0)
    # Without the mask the padding counts, and the loss is another one.
    assert (result["unmasked"].double() - expected).abs().max() > 1e-3 * expected.abs().max()
    num_real = sum(LENGTHS)
    assert torch.equal(result["counts"].sum(dim=1), torch.full((len(expected),), float(num_real * result["topk"])))


def test_a_padding_mask_of_another_shape_is_refused(result):
    assert "padding_mask has shape (3, 15)" in result["bad_mask_error"]
    assert "input_ids' shape (3, 16)" in result["bad_mask_error"]
