"""The MiniMax-M2 family (#57) against transformers' MiniMaxM2ForCausalLM: a tiny random M2 (4 layers of
softmax attention with QK-norm, partial RoPE over 8 of 16 channels, 8 experts routed top-2 by sigmoid
scores chosen with a random selection bias) saved by save_pretrained.

- hf-to-megatron, then megacispo.score at TP 1, TP 2, EP 2, PP 2, TP 2 x EP 2 (expert TP 1), and at CP 2
  with each softmax scheme (sequences of 7, 1, 41 and 20 tokens, rows padded to 2 x CP): the log-probs
  equal transformers' to 1e-5 (fp32).
- The RL trainer's own passes, the weights read from the HF directory as train.load reads them, sequences
  of odd lengths packed into rows: the old log-probs equal transformers' to 1e-5, and the gradients of the
  CISPO loss those of the same loss written over transformers' model, at TP 1, TP 2, EP 2, PP 2 and CP 2.
- HF -> megacispo -> HF is bit-exact, selection biases and QK-norms included, and config.json names
  MiniMaxM2ForCausalLM with the released configs' routing fields.
- Block-quantized FP8 checkpoints (as the M2 line is released) are read dequantized; multi-token-prediction
  modules are passed over, saying so; a quantization megacispo does not read is refused naming it.
- An M2 config field megacispo does not compute is refused naming it; an M1 directory read as M2 (and
  the reverse) is one clean line.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from megacispo.models.config import M2
from megacispo.testing.harness import run_distributed
from megacispo.testing.parallel_case import assert_close_by_key
from megacispo.testing.hf_models import SEQUENCES, convert_and_score, hf_model, score_main, write_hf_model

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

TOLERANCE = 1e-5  # |log-prob - transformers' log-prob| (fp32: they agree to about 2e-6)

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


# The trainer's passes: sequences of 7, 41, 20 and 3 tokens (their first PROMPTS[i] tokens the prompt), packed
# by a budget of 48 tokens, so that rows hold several sequences and split them at odd places under CP.
GRADIENT_SEQUENCES = (SEQUENCES[0], SEQUENCES[2], SEQUENCES[3], [4, 9, 13])
PROMPTS = (3, 5, 2, 2)
ADVANTAGES = (1.0, -0.5, 0.8, -1.2)
GRADIENT_LAYOUTS = {
    "tp1": {}, "tp2": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "ep2": {"expert_model_parallel_size": 2}, "pp2": {"pipeline_model_parallel_size": 2},
    "cp2": {"context_parallel_size": 2},
}


def _rows(index: range, moe_layers: int, topk: int) -> dict[str, torch.Tensor]:
    """GRADIENT_SEQUENCES[index] right-padded as the trainer batches a step; the rollout's experts (which
    only the router-disagreement metric reads: routing replay is off) are expert 0 everywhere."""
    sequences = [GRADIENT_SEQUENCES[i] for i in index]
    width = max(len(tokens) for tokens in sequences)
    tokens = torch.tensor([tokens + [0] * (width - len(tokens)) for tokens in sequences])
    positions = torch.arange(width)
    real = positions < torch.tensor([len(tokens) for tokens in sequences])[:, None]
    response = real & (positions >= torch.tensor([PROMPTS[i] for i in index])[:, None])
    return {"tokens": tokens, "loss_mask": response[:, 1:].float(), "padding_mask": ~real,
            "advantages": torch.tensor([ADVANTAGES[i] for i in index]),
            "rollout_logprobs": torch.zeros(len(sequences), width - 1),
            "routes": torch.zeros(len(sequences), width, moe_layers, topk, dtype=torch.uint8)}


def _m2_update(hf_dir: str, layout: dict) -> dict:
    """The old log-probs of this rank's rows (its data-parallel share of GRADIENT_SEQUENCES), the loss (last
    pipeline stage; else None) and the pieces of the gradients of one CISPO update that this rank holds, on
    the tiny M2 of ``hf_dir`` read by load_hf_weights (train.load's reader) at ``layout``."""
    import dataclasses

    import torch.distributed as dist
    from megatron.core.utils import unwrap_model

    from megacispo.checkpoint.formats import read_hf_config
    from megacispo.checkpoint.hf import load_hf_weights
    from megacispo.config import Config
    from megacispo.models.hf_names import config_from_hf
    from megacispo.parallel.layout import ParallelConfig
    from megacispo.parallel.sharded import gradient_pieces
    from megacispo.rl.trainer import TrainBatch
    from megacispo.testing.trainers import build_trainer
    from megacispo.training.config import OptimizerConfig, TrainConfig

    model = dataclasses.replace(config_from_hf(read_hf_config(hf_dir)), moe_aux_loss_coeff=0.0)
    config = Config(model=model, parallel=ParallelConfig(**layout),
                    train=TrainConfig(pack_sequences=True, max_tokens_per_micro_batch=48, run_dir="runs/unused"),
                    optimizer=OptimizerConfig(use_distributed_optimizer=False, clip_grad=0.0))
    trainer = build_trainer(config)
    load_hf_weights(trainer.engine.module, hf_dir)
    rank, size = dist.get_rank(trainer.dp_group), dist.get_world_size(trainer.dp_group)
    rows = range(rank * len(GRADIENT_SEQUENCES) // size, (rank + 1) * len(GRADIENT_SEQUENCES) // size)
    batch = TrainBatch(**_rows(rows, len(unwrap_model(trainer.engine.module).decoder.layers), model.moe_router_topk))
    batch.old_logprobs = trainer.compute_old_logprobs(batch)
    pieces, step = [], trainer.engine.step

    def step_keeping_gradients():
        pieces.extend(gradient_pieces(unwrap_model(trainer.engine.module)))
        return step()

    trainer.engine.step = step_keeping_gradients
    metrics = trainer._update_once(batch)
    return {"rows": list(rows), "old_logprobs": batch.old_logprobs, "loss": metrics.get("loss/policy_loss"),
            "pieces": pieces}


@pytest.fixture(scope="module")
def m2_reference(m2_hf):
    """transformers' log-probs of GRADIENT_SEQUENCES, and its CISPO loss (the ratio to the old policy is 1, so
    -A * log p of each response token over their number) and gradients as our full tensors (checkpoint keys)."""
    from megacispo.models.hf_names import ROUTER_BIAS_KEY, config_from_hf
    from megacispo.testing.hf_models import hf_to_full

    model = hf_model(M2)
    logprobs, loss, num_tokens = [], 0.0, 0
    for tokens, prompt, advantage in zip(GRADIENT_SEQUENCES, PROMPTS, ADVANTAGES):
        ids = torch.tensor(tokens)[None]
        sequence = torch.log_softmax(model(ids).logits.float(), dim=-1)[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
        logprobs.append(sequence.detach())
        loss = loss - advantage * sequence[prompt - 1:].sum()
        num_tokens += len(tokens) - prompt
    loss = loss / num_tokens
    loss.backward()
    hf_grads = {name: param.grad for name, param in model.named_parameters()}
    hf_grads.update({name: torch.zeros_like(buffer) for name, buffer in model.named_buffers()
                     if name.endswith("e_score_correction_bias")})
    grads = hf_to_full(hf_grads, config_from_hf(model.config))
    return {"logprobs": logprobs, "loss": loss.item(),
            "grads": {key: grad for key, grad in grads.items() if not key.endswith(ROUTER_BIAS_KEY)}}


@pytest.mark.parametrize("layout", list(GRADIENT_LAYOUTS))
def test_m2_packed_training_passes_equal_transformers(m2_hf, m2_reference, layout):
    from megacispo.parallel.sharded import assemble

    root, _ = m2_hf
    world_size = 1 if layout == "tp1" else 2
    results = run_distributed(_m2_update, world_size, str(root / "hf"), GRADIENT_LAYOUTS[layout])
    for result in results:
        for row, index in enumerate(result["rows"]):
            tokens, prompt = GRADIENT_SEQUENCES[index], PROMPTS[index]
            expected = m2_reference["logprobs"][index][prompt - 1:]
            torch.testing.assert_close(result["old_logprobs"][row, prompt - 1:len(tokens) - 1], expected,
                                       rtol=0, atol=TOLERANCE)
    losses = [result["loss"] for result in results if result["loss"] is not None]  # the last pipeline stage's
    assert losses and losses == pytest.approx([m2_reference["loss"]] * len(losses), rel=1e-5)
    grads = assemble([result["pieces"] for result in results])
    assert_close_by_key(m2_reference["grads"], {key: grads[key] for key in m2_reference["grads"]},
                        f"{layout}: gradient of", rtol=1e-5)


def _score_at_cp2(root: Path, checkpoint: Path, comm: str) -> list[torch.Tensor]:
    out = root / f"cp2_{comm}.jsonl"
    run_distributed(score_main, 2, ["--load", str(checkpoint), "--tokens", str(root / "tokens.jsonl"), "--out", str(out),
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
    assert not config["use_mtp"] and config["num_mtp_modules"] == 0  # no MTP tensors are written


def test_m2_multi_token_prediction_modules_are_passed_over_saying_so(m2_hf, tmp_path):
    """A released M2 config.json names MTP modules (use_mtp, num_mtp_modules), kept as the layers after
    the last: their tensors are passed over with a warning that says so; a tensor of any other layer
    past the model's is still unknown."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from megacispo.checkpoint.hf_reader import check_hf_checkpoint
    from megacispo.models.hf_names import config_from_hf

    root, _ = m2_hf
    hf = tmp_path / "hf"
    shutil.copytree(root / "hf", hf)
    config = {**json.loads((hf / "config.json").read_text()), "use_mtp": True, "num_mtp_modules": 2}
    (hf / "config.json").write_text(json.dumps(config))
    mtp = {f"model.layers.{layer}.{name}.weight": torch.ones(4) for layer in (4, 5) for name in ("enorm", "hnorm")}
    save_file(mtp, str(hf / "mtp.safetensors"))
    with safe_open(str(hf / "model.safetensors"), framework="pt") as handle:
        weight_map = {name: "model.safetensors" for name in handle.keys()}
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {**weight_map, **dict.fromkeys(mtp, "mtp.safetensors")}}))
    with pytest.warns(UserWarning, match=r"4 tensors of 2 multi-token-prediction modules \(model.layers.4.\* \.\.\.\) "
                                         r"are not read: megacispo's MiniMax-M2 has no MTP modules"):
        check_hf_checkpoint(hf, config_from_hf(config))
    (hf / "config.json").write_text(json.dumps({**config, "num_mtp_modules": 1}))
    unknown = r"^unknown HF tensor model.layers.5.enorm.weight in .*mtp.safetensors"
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=unknown):
        check_hf_checkpoint(hf, config_from_hf(config))


FP8_BLOCK = (40, 40)  # partial blocks at the edges of the tiny model's 64- and 96-wide matrices


def _quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's block quantization of a [out, in] weight: its FP8 values and each block's factor
    (the block's largest magnitude over FP8's largest, 448)."""
    rows, cols = weight.shape
    block_rows, block_cols = -(-rows // FP8_BLOCK[0]), -(-cols // FP8_BLOCK[1])
    padded = weight.new_zeros(block_rows * FP8_BLOCK[0], block_cols * FP8_BLOCK[1])
    padded[:rows, :cols] = weight
    tiles = padded.reshape(block_rows, FP8_BLOCK[0], block_cols, FP8_BLOCK[1])
    scale_inv = tiles.abs().amax(dim=(1, 3)) / 448.0
    values = (tiles / scale_inv[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
    return values.to(torch.float8_e4m3fn), scale_inv


def test_a_block_quantized_fp8_m2_checkpoint_is_read_dequantized(m2_hf, tmp_path):
    """The released M2 checkpoints are block-quantized FP8: the tiny M2's projections and experts so
    quantized (F8_E4M3 and *_scale_inv), converted at TP 2 x EP 2, score what transformers scores on the
    dequantized weights, and converted back give those weights bit for bit (megacispo writes no FP8); an
    FP8 weight without its factors is refused naming both."""
    from safetensors.torch import load_file, save_file
    from transformers import MiniMaxM2ForCausalLM

    from megacispo.checkpoint.hf_reader import check_hf_checkpoint
    from megacispo.checkpoint.hf_reader import dequantize_fp8
    from megacispo.models.hf_names import config_from_hf
    from megacispo.testing.hf_models import hf_logprobs

    root, _ = m2_hf
    original = load_file(str(root / "hf" / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, tensor in original.items():
        if re.search(r"(_proj|experts\.\d+\.w\d)\.weight$", name):
            values, scale_inv = _quantize_fp8(tensor)
            quantized.update({name: values, name + "_scale_inv": scale_inv})
            dequantized[name] = dequantize_fp8(values, scale_inv, FP8_BLOCK)
        else:
            quantized[name] = dequantized[name] = tensor
    config = json.loads((root / "hf" / "config.json").read_text())
    for directory, tensors, extra in [("fp8", quantized, {"quantization_config": {
            "quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK)}}), ("dequantized", dequantized, {})]:
        (tmp_path / directory).mkdir()
        save_file(tensors, str(tmp_path / directory / "model.safetensors"))
        (tmp_path / directory / "config.json").write_text(json.dumps({**config, **extra}))
    assert not torch.equal(dequantized["model.layers.0.self_attn.q_proj.weight"],
                           original["model.layers.0.self_attn.q_proj.weight"])
    reference = hf_logprobs(MiniMaxM2ForCausalLM.from_pretrained(str(tmp_path / "dequantized")).eval())
    shutil.copy(root / "tokens.jsonl", tmp_path / "tokens.jsonl")
    (tmp_path / "fp8").rename(tmp_path / "hf")
    checkpoint, ours = convert_and_score(tmp_path, ["--tp", "2", "--ep", "2", "--etp", "1"], 2)
    for expected, logprobs in zip(reference, ours, strict=True):
        torch.testing.assert_close(logprobs, expected, rtol=0, atol=TOLERANCE)
    run_distributed(_to_hf, 1, str(checkpoint), str(tmp_path / "back"))
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    back = {name: tensor for file_name in set(index["weight_map"].values())
            for name, tensor in load_file(str(tmp_path / "back" / file_name)).items()}
    assert back.keys() == dequantized.keys()
    for name, tensor in back.items():
        assert torch.equal(tensor, dequantized[name]), name
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())
    scale = "model.layers.1.block_sparse_moe.experts.5.w2.weight_scale_inv"
    (tmp_path / "hf" / "model.safetensors").unlink()
    save_file({name: tensor for name, tensor in quantized.items() if name != scale},
              str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"^HF tensor {scale.removesuffix('_scale_inv')} in .* is F8_E4M3 without "
                                         rf"its {scale}: the checkpoint is incomplete"):
        check_hf_checkpoint(tmp_path / "hf", config_from_hf(config))


def _to_hf(checkpoint: str, out: str) -> None:
    from megacispo.checkpoint.to_hf import megatron_to_hf

    megatron_to_hf(checkpoint, out, progress=False)


@pytest.mark.parametrize("quantization, message", [
    ({"quant_method": "awq", "bits": 4}, "quantization_config = {'quant_method': 'awq', 'bits': 4}: megacispo reads "
                                         "unquantized checkpoints and block-quantized FP8 ones"),
    ({"quant_method": "fp8", "weight_block_size": None}, "quantization_config = {'quant_method': 'fp8', "
                                                         "'weight_block_size': None}"),
])
def test_a_quantization_megacispo_does_not_read_is_refused_naming_it(m2_hf, tmp_path, quantization, message):
    from megacispo.checkpoint.hf_reader import check_hf_checkpoint
    from megacispo.models.config import model_config

    root, _ = m2_hf
    shutil.copytree(root / "hf", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(ValueError, match=re.escape(message)):
        check_hf_checkpoint(tmp_path / "hf", model_config("tiny-m2"))


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
