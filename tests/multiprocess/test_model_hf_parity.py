"""Our model equals Hugging Face transformers' MiniMaxForCausalLM: a tiny random HF model (the config
of MODEL.md, with non-trivial residual factors and large random weights so that every term
matters) is saved by save_pretrained, its on-disk tensors are loaded into our model through
hf_names, and the logits and log-probabilities agree to 1e-4 (fp32, TP = 1).

rotary_dim = head_dim here because HF rotates whole heads (MODEL.md); the original MiniMax rotates
half of each head, which only our model can express.
"""

from __future__ import annotations

import pytest
import torch

from megacispo.testing import hf_models
from megacispo.testing.harness import run_distributed

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

SEQ_LEN = 40  # two full lightning blocks of 16 and a partial one
BATCH = 2
TOLERANCE = 1e-4


def _parity(save_dir: str) -> dict:
    from safetensors.torch import load_file
    from transformers import MiniMaxForCausalLM

    from megacispo.models import hf_names
    from megacispo.models.config import transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    hf_config = hf_models.hf_config()
    hf_model = MiniMaxForCausalLM(hf_config).eval()
    hf_models.randomize(hf_model)
    hf_model.save_pretrained(save_dir)
    on_disk = load_file(f"{save_dir}/model.safetensors")

    config = hf_names.config_from_hf(hf_config)
    parallel = ParallelConfig()
    init_distributed(parallel, seed=0)
    model = HybridModel(config, transformer_config(config, parallel)).eval()
    full = hf_models.hf_to_full(on_disk, config)
    missing, unexpected = model.load_state_dict(hf_models.full_to_single_process(full), strict=False)

    input_ids = torch.randint(0, hf_config.vocab_size, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hf_logits = hf_model(input_ids).logits
        our_logits = model(input_ids)
    in_memory = {name: tensor.detach() for name, tensor in hf_model.state_dict().items()}
    return {
        "config": config,
        "missing": [key for key in missing if not key.endswith("_extra_state")],
        "unexpected": unexpected,
        "hf_logits": hf_logits,
        "our_logits": our_logits,
        "full": full,
        "full_from_fused": hf_models.hf_to_full(in_memory, config),
        "on_disk": on_disk,
        "in_memory": in_memory,
        # The lightning output norm's epsilon barely moves these logits (its variance is far
        # above 1e-6), so it is compared directly.
        "hf_lightning_norm_eps": hf_model.model.layers[0].self_attn.norm.variance_epsilon,
        "our_lightning_norm_eps": model.decoder.layers[0].self_attention.norm.eps,
        "hf_norm_eps": hf_model.model.layers[0].input_layernorm.variance_epsilon,
        "our_norm_eps": model.decoder.layers[0].input_layernorm.eps,
    }


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    (result,) = run_distributed(_parity, 1, str(tmp_path_factory.mktemp("hf")))
    return result


def test_every_tensor_is_mapped(parity):
    assert parity["missing"] == [] and parity["unexpected"] == []


def test_norm_epsilons_equal_hf(parity):
    assert parity["our_lightning_norm_eps"] == parity["hf_lightning_norm_eps"] == 1e-6
    assert parity["our_norm_eps"] == parity["hf_norm_eps"] == 1e-5


def test_logits_equal_hf(parity):
    hf_logits, our_logits = parity["hf_logits"], parity["our_logits"]
    assert hf_logits.abs().max() > 1.0, "the test model must produce non-trivial logits"
    torch.testing.assert_close(our_logits, hf_logits, rtol=0, atol=TOLERANCE)


def test_logprobs_equal_hf(parity):
    hf_logprobs = torch.log_softmax(parity["hf_logits"].double(), dim=-1)
    our_logprobs = torch.log_softmax(parity["our_logits"].double(), dim=-1)
    torch.testing.assert_close(our_logprobs, hf_logprobs, rtol=0, atol=TOLERANCE)


def test_both_hf_expert_layouts_give_the_same_tensors(parity):
    full, from_fused = parity["full"], parity["full_from_fused"]
    assert full.keys() == from_fused.keys()
    for key in full:
        torch.testing.assert_close(from_fused[key], full[key], rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["legacy", "fused"])
def test_names_round_trip(parity, layout):

    hf_tensors = hf_models.full_to_hf(parity["full"], parity["config"], experts_layout=layout)
    reference = parity["on_disk"] if layout == "legacy" else parity["in_memory"]
    derived = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
    assert hf_tensors.keys() == {name for name in reference if not name.endswith(derived)}
    for name, tensor in hf_tensors.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0)
