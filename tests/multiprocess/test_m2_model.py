"""The MiniMax-M2 family (#57) against transformers' MiniMaxM2ForCausalLM: a tiny random M2 (4 layers of
softmax attention with QK-norm, partial RoPE over 8 of 16 channels, 8 experts routed top-2 by sigmoid
scores chosen with a random selection bias) saved by save_pretrained.

- hf-to-megatron, then megacispo.score at TP 1, TP 2, EP 2, PP 2, TP 2 x EP 2 (expert TP 1), and at CP 2
  with each softmax scheme (sequences of 7, 1, 41 and 20 tokens, rows padded to 2 x CP): the log-probs
  equal transformers' to 1e-4 (fp32; they agree to about 2e-6).
- HF -> megacispo -> HF is bit-exact, selection biases and QK-norms included, and config.json names
  MiniMaxM2ForCausalLM with the released configs' routing fields.
- An M2 config field megacispo does not compute is refused naming it; an M1 directory read as M2 (and
  the reverse) is one clean line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from megacispo.models.config import M2
from megacispo.testing.harness import run_distributed
from megacispo.testing.hf_models import TOLERANCE, convert_and_score, write_hf_model

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

LAYOUTS = {"tp1": ([], 1), "tp2": (["--tp", "2"], 2), "ep2": (["--ep", "2"], 2),
           "pp2": (["--pp", "2"], 2), "tp2_ep2": (["--tp", "2", "--ep", "2", "--etp", "1"], 2)}


@pytest.fixture(scope="module")
def m2_hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("m2")
    return root, write_hf_model(root, M2)


@pytest.fixture(scope="module")
def m2_checkpoint(m2_hf):
    """The tiny M2 converted at TP 1, and transformers' log-probs."""
    root, reference = m2_hf
    checkpoint, ours = convert_and_score(root, [], 1)
    return root, checkpoint, reference, ours


@pytest.mark.parametrize("layout", [*LAYOUTS, "cp2_all_gather", "cp2_p2p"])
def test_m2_logprobs_equal_transformers(m2_checkpoint, layout):
    root, checkpoint, reference, ours = m2_checkpoint
    if layout.startswith("cp2"):
        ours = _score_at_cp2(root, checkpoint, layout.removeprefix("cp2_"))
    elif layout != "tp1":
        _, ours = convert_and_score(root, *LAYOUTS[layout])
    assert [len(logprobs) for logprobs in ours] == [len(logprobs) for logprobs in reference]
    for expected, logprobs in zip(reference, ours):
        torch.testing.assert_close(logprobs, expected, rtol=0, atol=TOLERANCE)


def _score(argv: list[str]) -> int:
    from megacispo.score import main

    return main(argv)


def _score_at_cp2(root: Path, checkpoint: Path, comm: str) -> list[torch.Tensor]:
    out = root / f"cp2_{comm}.jsonl"
    run_distributed(_score, 2, ["--load", str(checkpoint), "--tokens", str(root / "tokens.jsonl"), "--out", str(out),
                                "--set", "parallel.context_parallel_size=2",
                                "--set", f"parallel.context_parallel_comm={comm}"])
    return [torch.tensor(json.loads(line)["logprobs"], dtype=torch.float64) for line in out.read_text().splitlines()]


def _round_trip(root: str) -> None:
    from megacispo.checkpoint.to_hf import megatron_to_hf
    from megacispo.checkpoint.to_megatron import hf_to_megatron

    root = Path(root)
    hf_to_megatron(root / "hf", root / "ckpt_round_trip", ep=2, progress=False)
    megatron_to_hf(root / "ckpt_round_trip", root / "hf_back", progress=False)


def test_m2_round_trip_is_bit_exact(m2_hf):
    from safetensors.torch import load_file

    root, _ = m2_hf
    run_distributed(_round_trip, 1, str(root))
    original, back = load_file(str(root / "hf" / "model.safetensors")), {}
    index = json.loads((root / "hf_back" / "model.safetensors.index.json").read_text())
    for file_name in set(index["weight_map"].values()):
        back.update(load_file(str(root / "hf_back" / file_name)))
    assert back.keys() == original.keys()
    assert any(name.endswith("e_score_correction_bias") for name in back) and any("q_norm" in name for name in back)
    for name, tensor in back.items():
        assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), name
    config = json.loads((root / "hf_back" / "config.json").read_text())
    assert config["architectures"] == ["MiniMaxM2ForCausalLM"] and config["model_type"] == "minimax_m2"
    assert config["scoring_func"] == "sigmoid" and config["use_routing_bias"] and config["rotary_dim"] == 8


@pytest.mark.parametrize("field, value, message", [
    ("scoring_func", "softmax", "HF config field scoring_func = 'softmax': megacispo's MiniMax-M2 computes "
                                "scoring_func = 'sigmoid' only"),
    ("use_qk_norm", False, "HF config field use_qk_norm = False"),
    ("shared_intermediate_size", 1024, "HF config field shared_intermediate_size = 1024"),
    ("rope_scaling", {"type": "yarn", "factor": 4.0}, "HF config rope type 'yarn' (rope_parameters or rope_scaling)"),
    ("num_expert_group", 4, "HF config fields num_expert_group = 4, topk_group = None"),
])
def test_an_m2_field_megacispo_does_not_compute_is_refused_by_name(field, value, message):
    from megacispo.models.config import model_config
    from megacispo.models.hf_names import config_from_hf, config_to_hf

    hf_config = {**config_to_hf(model_config("tiny-m2")), "model_type": "minimax_m2", field: value}
    if field == "rope_scaling":  # a released config's field, which transformers turns into rope_parameters
        del hf_config["rope_parameters"]
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        config_from_hf(hf_config)


def test_an_m2_checkpoint_loaded_as_m1_and_the_reverse_is_one_line(m2_checkpoint):
    """The family is part of what a checkpoint's tensors are: an M2 checkpoint under an M1 config is refused
    naming model.family (a checkpoint saved before the field existed is M1's), and a run config that calls
    an M2 Hugging Face directory M1 is refused naming both values."""
    from megacispo.checkpoint.distributed import check_model
    from megacispo.checkpoint.formats import CheckpointError
    from megacispo.config import load_config
    from megacispo.models.config import model_config

    root, checkpoint, _, _ = m2_checkpoint
    with pytest.raises(CheckpointError, match=r"holds another model: model.family = 'minimax-m1' \(checkpoint: "
                                              r"'minimax-m2'\)"):
        check_model(checkpoint / "step_00000000", model_config("tiny"))
    with pytest.raises(ValueError, match=r"^model.family = 'minimax-m1' in the config but 'minimax-m2' in "
                                         r".*config.json \(train.load\): remove it or make them agree"):
        load_config(None, [f"train.load={root / 'hf'}", "model.family=minimax-m1"], load_field="train.load")
