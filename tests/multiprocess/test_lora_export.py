"""A LoRA run's checkpoint out of megacispo (megacispo.checkpoint.to_hf through tools/convert_checkpoint.py).

Tiny random transformers models (megacispo.testing.hf_models) are the bases (train.load) of LoRA models with
random adapters: on MiniMax-M1, one on every target (experts too) and one on the attention projections alone
(lightning and softmax layers); on MiniMax-M2 (MiniMaxM2ForCausalLM: QK-norm, partial RoPE, sigmoid router),
one on all-linear (q/k/v/o_proj and the experts' linear_fc1/fc2) and one on q/k/v/o_proj. Each is trained one
step (the checkpoint then holds optimizer state of the adapters too), given random B, and saved as a LoRA run
saves it: its adapters alone, the base recorded as extra_state.lora_base.

- megatron-to-hf writes the merged model: transformers' log-probs of it equal the unmerged LoRA model's
  (both in fp64, so that only the fp32 rounding of the merged weights differs; transformers' experts
  then run eagerly: its grouped GEMM takes no fp64) to 1e-5, for M1's two models and M2's all-linear one;
  on M1, megacispo.score of it (fp32) gives the unmerged model's log-probs to 1e-5 too, and with --base the
  same base as a megacispo checkpoint gives the same tensors, bit for bit.
- megatron-to-peft writes the attention adapters in PEFT's layout: PeftModel over the base HF model
  gives the unmerged model's log-probs to 1e-5, on M1 and on M2.
- Bad inputs (M1 alone: a base that is not there, a base recorded at a path that moved, a base of another
  model, a PEFT export of expert adapters, a PEFT export of a whole model, --base for a whole model) end with
  exit code 2 and one ``error:`` line naming the field or the file and the fix, and write nothing.

M2's part (its own module fixture: the two runs, the two exports above) adds about 7 s on two idle CPU cores
(M1's fixture: about 12 s).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from megacispo.models.config import M1, M2
from megacispo.testing.harness import run_distributed
from megacispo.testing.hf_models import SEQUENCES, hf_config, hf_logprobs, hf_model, score_main

pytest.importorskip("transformers")
pytest.importorskip("peft")

TOLERANCE = 1e-5
LORA = ["lora.rank=4", "lora.alpha=8", "lora.dropout=0.05", "optimizer.use_distributed_optimizer=false"]
TARGETS = {
    M1: {"all": "[qkv_proj,output_gate,out_proj,q_proj,k_proj,v_proj,o_proj,linear_fc1,linear_fc2]",
         "attention": "[qkv_proj,output_gate,out_proj,q_proj,k_proj,v_proj,o_proj]"},
    M2: {"all": "[all-linear]", "attention": "[q_proj,k_proj,v_proj,o_proj]"},
}
# Each family's fixture; PeftModel's adapted parameters (A and B of each adapted linear) of its attention model:
# M1's 7 lightning layers x 3 linears + 1 softmax layer x 4, M2's 4 softmax layers x 4.
FIXTURES = {M1: "exported", M2: "exported_m2"}
PEFT_ADAPTED = {M1: 2 * (7 * 3 + 4), M2: 2 * 4 * 4}
MERGED = [(M1, "all"), (M1, "attention"), (M2, "all")]


def _tool(argv: list[str]) -> tuple[int, str]:
    """tools/convert_checkpoint.py in this process: its exit code and what it wrote to stderr."""
    from megacispo.testing.tool_modules import load_tool

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            code = load_tool("convert_checkpoint").main(argv)
        except SystemExit as exit_:
            code = exit_.code
    return code, stderr.getvalue()


def _lora_runs(root: Path, targets: dict[str, str]) -> tuple[dict, dict]:
    """One LoRA model over ``root/hf`` for each of ``targets``, trained one step, given random B and saved in
    ``root/run_NAME``: the unmerged models' fp64 log-probs and the checkpoints' step directories, by name."""
    from megacispo.checkpoint.distributed import save_checkpoint
    from megacispo.checkpoint.hf import load_start_weights
    from megacispo.config import to_dict
    from megacispo.models.lora import adapted_linears
    from megacispo.startup import run_config
    from megacispo.testing.parallel_case import one_update
    from megacispo.training.engine import Engine

    tokens = torch.tensor([SEQUENCES[0] * 2])
    generator = torch.Generator().manual_seed(5)
    logprobs, checkpoints = {}, {}
    for name, target_list in targets.items():
        config = run_config(None, [*LORA, f"lora.targets={target_list}", f"train.load={root / 'hf'}"],
                            load_field="train.load")
        engine = Engine(config, total_steps=1, peak_lr=1e-2)
        load_start_weights("train.load", config.train.load, engine)
        assert one_update(engine, tokens)[0].applied
        model = engine.module
        with torch.no_grad():
            for linear in adapted_linears(model):
                linear.lora_B.copy_(torch.randn(linear.lora_B.shape, generator=generator) * 0.05)
        checkpoints[name] = save_checkpoint(
            root / f"run_{name}", 1, model, engine.optimizer, engine.scheduler, config_dict=to_dict(config),
            extra_state={"lora_base": {"train.load": str(root / "hf"), "fingerprint": [0.0, 0.0]}})
        model.eval().double()
        with torch.no_grad():
            logprobs[name] = []
            for sequence in SEQUENCES:
                ids = torch.tensor(sequence)[None]
                scores = torch.log_softmax(model(ids).double(), dim=-1)[0, :-1]
                logprobs[name].append(scores.gather(-1, ids[0, 1:, None])[:, 0])
    return logprobs, checkpoints


def _bad_inputs(root: Path, attention_checkpoint: Path) -> dict[str, list[str]]:
    """M1's bad inputs: a copy of the attention checkpoint whose recorded base moved, and each case's argv."""
    moved = root / "moved" / attention_checkpoint.name
    moved.parent.mkdir()
    shutil.copytree(attention_checkpoint, moved)
    meta = json.loads((moved / "meta.json").read_text())
    meta["extra_state"]["lora_base"]["train.load"] = str(root / "hf_moved")
    (moved / "meta.json").write_text(json.dumps(meta))
    return {
        "no_base": ["megatron-to-hf", "--ckpt", str(root / "run_all"), "--base", str(root / "nowhere")],
        "moved_base": ["megatron-to-hf", "--ckpt", str(moved)],
        "other_model": ["megatron-to-hf", "--ckpt", str(root / "run_all"), "--base", str(root / "hf_other")],
        "peft_experts": ["megatron-to-peft", "--ckpt", str(root / "run_all")],
        "peft_whole_model": ["megatron-to-peft", "--ckpt", str(root / "base_ckpt")],
        "base_for_whole_model": ["megatron-to-hf", "--ckpt", str(root / "base_ckpt"), "--base", str(root / "hf")],
    }


def _lora_exports(root: str, family: str) -> dict:
    """``family``'s LoRA checkpoints, their exports (M1: the bad inputs' errors too); the unmerged models'
    fp64 log-probs."""
    from megacispo.checkpoint.to_megatron import hf_to_megatron
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    root = Path(root)
    init_distributed(ParallelConfig(), seed=3)
    if family == M1:
        hf_to_megatron(root / "hf", root / "base_ckpt", progress=False)
    logprobs, checkpoints = _lora_runs(root, TARGETS[family])
    # --ckpt as a checkpoints root (its newest step) and (M1's merged_attention) as a step directory.
    exports = {
        "merged_all": ["megatron-to-hf", "--ckpt", str(root / "run_all"), "--out", str(root / "merged_all")],
        "peft": ["megatron-to-peft", "--ckpt", str(root / "run_attention"), "--out", str(root / "peft")],
    }
    bad = {}
    if family == M1:
        exports["merged_attention"] = ["megatron-to-hf", "--ckpt", str(checkpoints["attention"]),
                                       "--out", str(root / "merged_attention")]
        exports["merged_from_ckpt"] = ["megatron-to-hf", "--ckpt", str(root / "run_all"), "--out",
                                       str(root / "merged_from_ckpt"), "--base", str(root / "base_ckpt")]
        bad = _bad_inputs(root, checkpoints["attention"])
    results = {"logprobs": logprobs, "exports": {}, "errors": {}}
    for name, argv in exports.items():
        results["exports"][name] = _tool([*argv, *(["--no-progress"] if argv[0] == "megatron-to-hf" else [])])
    for name, argv in bad.items():
        out = root / f"out_{name}"
        code, stderr = _tool([*argv, "--out", str(out)])
        results["errors"][name] = {"code": code, "lines": [line for line in stderr.splitlines()
                                                             if line.startswith("error:")],
                                   "written": out.exists() or any(root.glob(f".tmp_out_{name}*"))}
    return results


def _export_family(root: Path, family: str) -> dict:
    """``family``'s tiny HF model saved in ``root/hf``, then _lora_exports of it in a new process."""
    hf_model(family).save_pretrained(root / "hf")
    (results,) = run_distributed(_lora_exports, 1, str(root), family)
    return {"root": root, "base_logprobs": hf_logprobs(_fp64_hf_model(root / "hf")), **results}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from transformers import MiniMaxForCausalLM

    root = tmp_path_factory.mktemp("lora_export")
    other = hf_config()
    other.intermediate_size = 48
    MiniMaxForCausalLM(other).save_pretrained(root / "hf_other")
    return _export_family(root, M1)


@pytest.fixture(scope="module")
def exported_m2(tmp_path_factory):
    return _export_family(tmp_path_factory.mktemp("lora_export_m2"), M2)


def _fp64_hf_model(directory: Path):
    """transformers' model of ``directory`` in fp64 and eval mode (its grouped expert GEMM takes no fp64:
    the experts run eagerly)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, experts_implementation="eager").eval().double()


def _assert_close(found: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for ours, reference in zip(found, expected, strict=True):
        torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("family", FIXTURES)
def test_exports_succeed(request, family):
    for name, (code, stderr) in request.getfixturevalue(FIXTURES[family])["exports"].items():
        assert code == 0, f"{name}: {stderr}"


@pytest.mark.parametrize(("family", "targets"), MERGED)
def test_merged_export_computes_the_unmerged_model(request, family, targets):
    exported = request.getfixturevalue(FIXTURES[family])
    merged = _fp64_hf_model(exported["root"] / f"merged_{targets}")
    # The adapters change the log-probs, and the merged weights compute what the unmerged adapters do.
    assert max((a - b).abs().max().item() for a, b in zip(exported["logprobs"][targets], exported["base_logprobs"])
               if len(a)) > 1e-2
    _assert_close(hf_logprobs(merged), exported["logprobs"][targets])


def test_megacispo_scores_the_merged_export_as_the_unmerged_model(exported, tmp_path):
    """megacispo.score of the merged export (fp32, its dtype) against the unmerged LoRA model (fp64)."""
    tokens, out = tmp_path / "tokens.jsonl", tmp_path / "scored.jsonl"
    tokens.write_text("".join(json.dumps({"tokens": list(sequence)}) + "\n" for sequence in SEQUENCES))
    (code,) = run_distributed(score_main, 1, ["--load", str(exported["root"] / "merged_all"), "--tokens",
                                              str(tokens), "--out", str(out)])
    assert code == 0
    scored = [torch.tensor(json.loads(line)["logprobs"], dtype=torch.float64) for line in out.read_text().splitlines()]
    _assert_close(scored, exported["logprobs"]["all"])


def test_merged_export_keeps_the_base_dtype_and_config(exported):
    root = exported["root"]
    config = json.loads((root / "merged_all" / "config.json").read_text())
    assert config["dtype"] == "float32" and config["intermediate_size"] == 96


def test_a_megacispo_base_merges_to_the_same_tensors(exported):
    from safetensors.torch import load_file

    def tensors(directory: Path) -> dict[str, torch.Tensor]:
        return {name: tensor for path in sorted(directory.glob("*.safetensors")) for name, tensor in
                load_file(str(path)).items()}

    from_hf, from_ckpt = tensors(exported["root"] / "merged_all"), tensors(exported["root"] / "merged_from_ckpt")
    assert from_hf.keys() == from_ckpt.keys()
    assert all(torch.equal(from_hf[name], from_ckpt[name]) for name in from_hf)


@pytest.mark.parametrize("family", FIXTURES)
def test_peft_loads_the_adapters_over_the_base(request, family):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    exported = request.getfixturevalue(FIXTURES[family])
    root = exported["root"]
    config = json.loads((root / "peft" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["lora_dropout"] == 0.05 and config["base_model_name_or_path"] == str(root / "hf")
    assert config["target_modules"] == sorted(TARGETS[family]["attention"].strip("[]").split(","))
    base = AutoModelForCausalLM.from_pretrained(root / "hf", experts_implementation="eager")
    model = PeftModel.from_pretrained(base, root / "peft")
    adapted = {name for name, _ in model.named_parameters() if "lora_" in name}
    assert len(adapted) == PEFT_ADAPTED[family]
    _assert_close(hf_logprobs(model.eval().double()), exported["logprobs"]["attention"])


@pytest.mark.parametrize(("case", "fragments"), [
    ("no_base", ["--base", "nowhere", "no such file or directory", "pass --base"]),
    ("moved_base", ["meta.json extra_state.lora_base.train.load", "hf_moved", "no such file", "pass --base"]),
    ("other_model", ["--base", "hf_other/config.json", "model.moe_ffn_hidden_size = 48", "pass --base"]),
    ("peft_experts", ["adapters on the experts", "fused", "megatron-to-hf"]),
    ("peft_whole_model", ["holds a whole model", "no adapters", "megatron-to-hf"]),
    ("base_for_whole_model", ["--base", "holds a whole model", "drop --base"]),
])
def test_bad_inputs_give_one_error_line(exported, case, fragments):
    error = exported["errors"][case]
    assert error["code"] == 2 and len(error["lines"]) == 1, error
    for fragment in fragments:
        assert fragment in error["lines"][0], (fragment, error["lines"][0])
    assert not error["written"]
