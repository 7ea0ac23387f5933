"""The tiny random Hugging Face transformers MiniMax models the parity, conversion and scoring tests
compare with: M1's config (MODEL.md's, rotary_dim = head_dim because HF rotates whole heads) and M2's
(partial RoPE, QK-norm, the sigmoid router's selection bias), weights far from HF's init, the
sequences scored and transformers' log-probs of them, a conversion then scoring of it at a layout,
and damaged copies of an HF directory (``write_damaged_copy``). transformers and safetensors are
imported on use."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Mapping

import torch

from megacispo.models import hf_names
from megacispo.models.config import M1, M2, HybridModelConfig
from megacispo.testing.harness import run_distributed
from megacispo.testing.tool_modules import load_tool

TOLERANCE = 1e-4  # |log-prob - transformers' log-prob|
SEQUENCES = [
    [1, 5, 9, 200, 511, 3, 7],
    [4],
    list(range(10, 51)),  # 41 tokens: two lightning blocks of 16 and a partial one; odd under TP = 2
    [300, 2, 2, 2, 17, 99, 420, 8, 8, 64, 128, 256, 0, 511, 33, 1, 1, 1, 5, 6],
]


def hf_config():
    from transformers import MiniMaxConfig

    return MiniMaxConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=4,
        layer_types=["linear_attention"] * 7 + ["full_attention"], block_size=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        linear_attn_alpha_factor=2.0, linear_attn_beta_factor=0.8, full_attn_alpha_factor=1.5,
        full_attn_beta_factor=1.2, mlp_alpha_factor=1.7, mlp_beta_factor=0.9,
    )


def m2_hf_config(**fields):
    """A tiny MiniMaxM2Config: 4 layers, 8 experts (top 2), partial RoPE (8 of 16 channels), no
    special token ids (the released ones lie outside a 512-token vocabulary); ``fields`` override."""
    from transformers import MiniMaxM2Config

    return MiniMaxM2Config(**{
        "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8,
        "num_experts_per_tok": 2, "rotary_dim": 8, "max_position_embeddings": 4096, "bos_token_id": None,
        "eos_token_id": None, **fields,
    })


def randomize(hf_model) -> None:
    """Weights far from HF's tiny init, so that a wrong norm, gate, decay or routing shows; M2's
    selection biases too, as large as the sigmoid scores' spread, so that they change the choice."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif "embed_tokens" in name:
                param.copy_(noise)
            else:
                param.copy_(0.15 * noise)
        for name, buffer in hf_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn(buffer.shape, generator=generator))


def hf_model(family: str = M1, **m2_fields):
    """The tiny MiniMaxForCausalLM of ``hf_config`` (M2: MiniMaxM2ForCausalLM of ``m2_hf_config(**m2_fields)``),
    randomized, in eval mode."""
    from transformers import MiniMaxForCausalLM, MiniMaxM2ForCausalLM

    model = (MiniMaxM2ForCausalLM(m2_hf_config(**m2_fields)) if family == M2 else MiniMaxForCausalLM(hf_config()))
    model.eval()
    randomize(model)
    return model


def save_with_released_fields(hf_model, directory: Path) -> None:
    """``hf_model.save_pretrained(directory)``, its config.json with the fields of the released configs that
    transformers drops (M2's ``scoring_func``, ``use_routing_bias``...: hf_names.config_to_hf), which vLLM reads."""
    hf_model.save_pretrained(directory)
    config_path = Path(directory) / "config.json"
    released = hf_names.config_to_hf(hf_names.config_from_hf(hf_model.config))
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **released}))


def hf_logprobs(model) -> list[torch.Tensor]:
    """transformers' log p(tokens[i + 1] | tokens[: i + 1]) of each of SEQUENCES, fp64 softmax of its fp32 logits."""
    out = []
    with torch.no_grad():
        for tokens in SEQUENCES:
            ids = torch.tensor(tokens)[None]
            logprobs = torch.log_softmax(model(ids).logits.double(), dim=-1)[0, :-1]
            out.append(logprobs.gather(-1, ids[0, 1:, None])[:, 0])
    return out


def write_hf_model(root: Path, family: str = M1) -> list[torch.Tensor]:
    """A tiny random transformers MiniMax model of ``family`` in ``root/hf`` and its sequences in
    ``root/tokens.jsonl``; returns transformers' log-probs of them."""
    model = hf_model(family)
    model.save_pretrained(root / "hf")
    (root / "tokens.jsonl").write_text("".join(json.dumps({"tokens": tokens}) + "\n" for tokens in SEQUENCES))
    return hf_logprobs(model)


def _convert(argv: list[str]) -> int:
    return load_tool("convert_checkpoint").main(argv)


def score_main(argv: list[str]) -> int:
    """megacispo.score's main(argv), in a harness worker."""
    from megacispo.score import main

    return main(argv)


def _score_settings(layout_args: list[str]) -> list[str]:
    """The converter's layout flags (--tp 2 --ep 2) as megacispo.score's --set parallel.* settings."""
    fields = {"--tp": "tensor_model_parallel_size", "--pp": "pipeline_model_parallel_size",
              "--ep": "expert_model_parallel_size", "--etp": "expert_tensor_parallel_size"}
    return [arg for flag, value in zip(layout_args[::2], layout_args[1::2])
            for arg in ("--set", f"parallel.{fields[flag]}={value}")]


def convert_and_score(root: Path, layout_args: list[str], world_size: int) -> tuple[Path, list[torch.Tensor]]:
    """``tools/convert_checkpoint.py hf-to-megatron`` of ``root/hf`` with ``layout_args``, then
    ``torchrun --nproc-per-node world_size -m megacispo.score`` of it at that layout: the checkpoint
    and the log-probs of each sequence."""
    name = "_".join(arg.lstrip("-") for arg in layout_args)
    checkpoint, out = root / f"ckpt_{name}", root / f"scored_{name}.jsonl"
    run_distributed(_convert, 1, ["hf-to-megatron", "--hf-dir", str(root / "hf"), "--out", str(checkpoint),
                                  "--no-progress", *layout_args])
    run_distributed(score_main, world_size, ["--load", str(checkpoint), "--tokens", str(root / "tokens.jsonl"),
                                         "--out", str(out), *_score_settings(layout_args)])
    logprobs = [torch.tensor(json.loads(line)["logprobs"], dtype=torch.float64) for line in out.read_text().splitlines()]
    return checkpoint, logprobs


# Damaged copies of an HF directory (one with a single model.safetensors), and what their error names.
# (Expert 3 of 4: under EP = 2 only rank 1 reads it; layer 7 is the softmax layer.)
DAMAGES = {"nan": "model.layers.1.self_attn.out_proj.weight",
           "inf_expert": "model.layers.2.block_sparse_moe.experts.3.w2.weight",
           "int32": "model.layers.7.self_attn.q_proj.weight", "llama": "config.json"}


def write_damaged_copy(source: Path, directory: Path, damage: str) -> str:
    """A copy of the HF directory ``source`` at ``directory`` with one damage of DAMAGES: a NaN in a
    lightning layer's out_proj, an infinity in one expert's w2, the softmax layer's q_proj stored as
    int32, or a Llama config.json (its safetensors kept). Returns what the error must name."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory)
    if damage == "llama":
        (directory / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 8,
            "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 512, "rope_theta": 10_000.0}))
        return DAMAGES[damage]
    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    name = DAMAGES[damage]
    if damage == "nan":
        tensors[name][0, 1] = float("nan")
    elif damage == "inf_expert":
        tensors[name][2, 3] = float("inf")
    else:
        tensors[name] = (tensors[name] * 100).to(torch.int32)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return name


# Whole state dicts between our checkpoint keys and HF's.


def full_to_hf(
    tensors: Mapping[str, torch.Tensor], config: HybridModelConfig, experts_layout: str = hf_names.LEGACY
) -> dict[str, torch.Tensor]:
    """Our full tensors (checkpoint keys) -> HF tensors."""
    hf_tensors = {}
    for mapping in hf_names.tensor_mappings(config, experts_layout):
        if mapping.key not in tensors:
            raise ValueError(f"tensor {mapping.key} is missing from the model's tensors.")
        hf_tensors.update(mapping.to_hf(tensors[mapping.key]))
    return hf_tensors


def hf_to_full(hf_tensors: Mapping[str, torch.Tensor], config: HybridModelConfig) -> dict[str, torch.Tensor]:
    """HF tensors (either experts layout; derived decay buffers ignored) -> our full tensors."""
    layout = hf_names.detect_experts_layout(hf_tensors.keys())
    return {mapping.key: mapping.from_hf(hf_tensors) for mapping in hf_names.tensor_mappings(config, layout)}


def full_to_single_process(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full tensors -> the state_dict keys of a model built in one process (TP = PP = EP = 1),
    where each expert is its own module: ``mlp.experts.local_experts.E.linear_fc{1,2}.weight``."""
    state_dict = {}
    for key, tensor in tensors.items():
        for stacked in (hf_names.EXPERT_FC1_KEY, hf_names.EXPERT_FC2_KEY):
            if key.endswith(stacked):
                layer_prefix = key[: -len(stacked)]
                fc = stacked.rsplit(".", 2)[-2]
                for expert, matrix in enumerate(tensor.unbind(0)):
                    state_dict[f"{layer_prefix}mlp.experts.local_experts.{expert}.{fc}.weight"] = matrix
                break
        else:
            state_dict[key] = tensor
    return state_dict
