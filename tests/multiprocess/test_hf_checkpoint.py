"""Hugging Face directories in and out of training (megacispo.checkpoint.hf).

- ``load_hf_weights`` at TP 2 (sequence parallel), EP 2 and PP 2, in 2 gloo processes each, gives
  every rank exactly the parameters that the same HF directory converted by megacispo.checkpoint.to_megatron loads
  (and, in bf16, those parameters rounded to bf16); the pre-build shapes equal the model's.
- The model section of a run that starts from an HF directory is its config.json's; an explicit model
  field that disagrees is an error naming the field and both values; one that agrees passes.
- The acceptance run of issue #20: a tiny random MiniMaxForCausalLM with a byte-level BPE chat
  tokenizer (tools/make_tiny_hf.py) trains 2 RL steps at EP 2 from its HF directory on verl-layout
  Parquet math prompts, writing train.export_hf; transformers loads the export (model and tokenizer)
  and generates, and its fp32 log-probs equal megacispo.score's of the final checkpoint to 1e-4.
- bf16 RL and SFT runs from an HF directory keep its weights (the optimizer's fp32 master copies are
  refreshed after the load).
- Bad inputs (an unknown tensor, a wrong shape, no config.json, an existing export directory) end
  megacispo.train with exit code 2 and one ``error:`` line before any process group or model exists;
  a failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megacispo.testing.harness import run_distributed

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

TOLERANCE = 1e-4
LAYOUTS = {
    "tp2": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
    "ep2": {"expert_model_parallel_size": 2},
    "pp2": {"pipeline_model_parallel_size": 2},
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """An HF directory (megacispo.testing.hf_models' tiny random model, legacy expert layout) and its
    conversion by megacispo.checkpoint.to_megatron, the reference."""
    from megacispo.testing.hf_models import hf_model

    root = tmp_path_factory.mktemp("hf_weights")
    hf_model().save_pretrained(root / "hf")
    run_distributed(_convert, 1, str(root))
    return root


def _convert(root: str) -> None:
    from megacispo.checkpoint.to_megatron import hf_to_megatron

    hf_to_megatron(Path(root) / "hf", Path(root) / "ckpt", progress=False)


def _weights(model) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in model.state_dict().items()
            if isinstance(value, torch.Tensor) and not key.endswith("_extra_state")}


def _load_both_ways(root: str) -> dict[str, dict]:
    """Per layout (and bf16 at EP 2): the number of this rank's tensors, and the keys whose values
    differ between load_hf_weights and loading the converted checkpoint."""
    from megatron.core import parallel_state

    from megacispo.checkpoint.distributed import load_checkpoint
    from megacispo.checkpoint.formats import hf_model_config
    from megacispo.checkpoint.hf import load_hf_weights
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.training.engine import build_inference_model

    root = Path(root)
    config = hf_model_config(root / "hf")
    cases = {**{name: (fields, torch.float32) for name, fields in LAYOUTS.items()},
             "ep2_bf16": (LAYOUTS["ep2"], torch.bfloat16)}
    results = {}
    for name, (fields, dtype) in cases.items():
        parallel = ParallelConfig(**fields)
        init_distributed(parallel, seed=0)
        from_hf = build_inference_model(config, dtype, parallel)
        load_hf_weights(from_hf, root / "hf")
        reference = build_inference_model(config, torch.float32, parallel)
        load_checkpoint(root / "ckpt" / "step_00000000", reference, load_rng=False)
        expected, actual = _weights(reference), _weights(from_hf)
        differing = sorted(key for key in expected if not torch.equal(actual[key], expected[key].to(dtype)))
        results[name] = {"num_tensors": len(expected), "differing": differing,
                         "dtypes": sorted({str(t.dtype) for t in actual.values()})}
        parallel_state.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def loaded(converted):
    return run_distributed(_load_both_ways, 2, str(converted), timeout_s=600)


@pytest.mark.parametrize("layout", [*LAYOUTS, "ep2_bf16"])
def test_load_hf_weights_equals_the_converted_checkpoint(loaded, layout):
    for rank_result in loaded:
        result = rank_result[layout]
        assert result["num_tensors"] > 10
        assert result["differing"] == []
        assert result["dtypes"] == (["torch.bfloat16"] if layout.endswith("bf16") else ["torch.float32"])


def test_pre_build_shapes_are_the_models(converted):
    """model_tensor_shapes (the pre-build check's shapes, from the config alone) equals what the model
    built on the meta device holds, for two configs."""
    from megacispo.checkpoint.formats import hf_model_config
    from megacispo.checkpoint.hf_reader import model_tensor_shapes

    config = hf_model_config(converted / "hf")
    configs = [config, config.replace(num_query_groups=4, head_dim=16, rotary_dim=16, layer_pattern="LS", num_layers=4)]
    (results,) = run_distributed(_meta_shapes, 1, configs)
    for result, model in zip(results, configs):
        assert result == model_tensor_shapes(model)


def _meta_shapes(configs) -> list[dict]:
    from megacispo.checkpoint.to_megatron import checkpoint_contents

    return [{chunk.key: chunk.global_shape for chunk in checkpoint_contents(config, torch.float32)[0]}
            for config in configs]


# ---------------------------------------------------------------------------------------------
# The model section from config.json


@pytest.mark.parametrize("load_field", ["train.load", "sft.load"])
def test_hf_load_gives_the_model_of_its_config(converted, load_field):
    from megacispo.checkpoint.formats import hf_model_config
    from megacispo.startup import run_config

    hf_dir = converted / "hf"
    config = run_config(None, [f"{load_field}={hf_dir}", "model.num_layers=8", "model.fp32_lm_head=false"],
                         load_field=load_field)
    assert config.model == hf_model_config(hf_dir).replace(fp32_lm_head=False)
    assert config.model.num_layers == 8 and config.model.vocab_size == 512
    with pytest.raises(ValueError, match=rf"model.num_layers = 4 in the config but 8 in {hf_dir}/config.json "
                                         rf"\({load_field}\): remove it or make them agree"):
        run_config(None, [f"{load_field}={hf_dir}", "model.num_layers=4"], load_field=load_field)
    with pytest.raises(ValueError, match=r"model.size = 'tiny'.*remove model.size"):
        run_config(None, [f"{load_field}={hf_dir}", "model.size=tiny"], load_field=load_field)
    assert run_config(None, [f"{load_field}={hf_dir}"]).model.head_dim == 16, "no load_field: the tiny default"


# ---------------------------------------------------------------------------------------------
# The acceptance run: train from an HF directory, export one


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    """tools/make_tiny_hf.py's chat tokenizer and random model in one directory, and its Parquet math set."""
    from make_tiny_hf import build_model, build_tokenizer, math_problems, write_math_parquet

    root = tmp_path_factory.mktemp("tiny_hf")
    build_tokenizer(root / "hf")
    build_model(root / "hf", vocab_size=512)
    write_math_parquet(root / "train.parquet", math_problems(16, seed=0))
    return root


def _train_overrides(root: Path, run_dir: Path, hf_dir: Path, export: Path) -> list[str]:
    pairs = {
        "parallel.expert_model_parallel_size": 2,
        "data.train_prompts": root / "train.parquet", "data.tokenizer": root / "hf", "data.chat_template": "true",
        "data.prompt_key": "prompt", "data.answer_key": "reward_model.ground_truth",
        "rollout.prompts_per_step": 2, "rollout.group_size": 2, "rollout.max_new_tokens": 4,
        "rollout.dynamic_sampling": "false", "rl.updates_per_rollout": 1, "rl.reward": "boxed_math",
        "optimizer.lr": 1e-2, "train.run_dir": run_dir, "train.steps": 2, "train.micro_batch_size": 2,
        "train.load": hf_dir, "train.export_hf": export,
    }
    return [arg for key, value in pairs.items() for arg in ("--set", f"{key}={value}")]


def _train(argv: list[str]) -> None:
    from megacispo.train import main

    assert main(argv) == 0


def _score(argv: list[str]) -> None:
    from megacispo.score import main

    assert main(argv) == 0


SCORED = [[5, 17, 99, 300, 2, 41, 7, 7, 250, 1], list(range(30, 75))]


@pytest.fixture(scope="module")
def trained(tiny_hf):
    run_dir, export = tiny_hf / "run", tiny_hf / "export"
    run_distributed(_train, 2, _train_overrides(tiny_hf, run_dir, tiny_hf / "hf", export), timeout_s=600)
    (tiny_hf / "tokens.jsonl").write_text("".join(json.dumps({"tokens": t}) + "\n" for t in SCORED))
    run_distributed(_score, 2, ["--load", str(run_dir / "checkpoints"), "--tokens", str(tiny_hf / "tokens.jsonl"),
                                "--out", str(tiny_hf / "scored.jsonl"), "--set", "parallel.expert_model_parallel_size=2"],
                    timeout_s=300)
    return {"run_dir": run_dir, "export": export, "scored": tiny_hf / "scored.jsonl"}


def test_training_records_the_hf_model(tiny_hf, trained):
    """The run's model is the HF directory's (its config.json), recorded in the final checkpoint."""
    import dataclasses

    from megacispo.checkpoint.distributed import read_meta
    from megacispo.checkpoint.formats import hf_model_config

    step_dir = trained["run_dir"] / "checkpoints" / "step_00000002"
    meta = read_meta(step_dir)
    assert meta["config"]["model"] == dataclasses.asdict(hf_model_config(tiny_hf / "hf"))
    assert meta["config"]["train"]["export_hf"] == str(trained["export"])


def test_transformers_loads_the_export_and_matches_score(tiny_hf, trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = trained["export"]
    assert (export / "config.json").is_file() and (export / "tokenizer.json").is_file()
    assert not [p.name for p in export.parent.iterdir() if p.name.startswith(f".tmp_{export.name}")]
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 3
    assert isinstance(tokenizer.decode(generated[0]), str)

    original = AutoModelForCausalLM.from_pretrained(tiny_hf / "hf", dtype=torch.float32)
    moved = [name for name, tensor in model.state_dict().items()
             if not torch.equal(tensor, original.state_dict()[name])]
    assert moved, "2 RL steps at lr 1e-2 changed no weight: the export is not the trained model"

    records = [json.loads(line) for line in trained["scored"].read_text().splitlines()]
    assert [r["tokens"] for r in records] == SCORED
    with torch.no_grad():
        for record in records:
            ids = torch.tensor(record["tokens"])[None]
            logprobs = torch.log_softmax(model(ids).logits.double(), dim=-1)[0, :-1]
            expected = logprobs.gather(-1, ids[0, 1:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(record["logprobs"], dtype=torch.float64), expected,
                                       rtol=0, atol=TOLERANCE)


def _assert_bf16_copy_of_hf(hf_dir: Path, export: Path) -> None:
    """The export holds the HF directory's tensors rounded to bf16 (to a 1e-9 learning rate's step)."""
    from safetensors.torch import load_file

    from megacispo.checkpoint.hf_reader import DERIVED_SUFFIXES

    original = load_file(str(hf_dir / "model.safetensors"))
    index = json.loads((export / "model.safetensors.index.json").read_text())
    exported = {}
    for file_name in set(index["weight_map"].values()):
        exported.update(load_file(str(export / file_name)))
    assert exported.keys() == {name for name in original if not name.endswith(DERIVED_SUFFIXES)}
    for name, tensor in exported.items():
        assert tensor.dtype == torch.bfloat16
        torch.testing.assert_close(tensor.float(), original[name].bfloat16().float(), rtol=0, atol=1e-6)


def test_bf16_run_keeps_the_loaded_weights(tiny_hf, tmp_path):
    """A bf16 run's optimizer keeps fp32 master copies of the weights, made when it was built: they are
    refreshed from the loaded weights (else its first step writes the random initialization back).
    One step at a negligible learning rate exports the HF weights, rounded to bf16."""
    export = tmp_path / "export"
    argv = _train_overrides(tiny_hf, tmp_path / "run", tiny_hf / "hf", export)
    argv += ["--set", "precision.params_dtype=bfloat16", "--set", "train.steps=1", "--set", "optimizer.lr=1e-9"]
    run_distributed(_train, 2, argv, timeout_s=600)
    _assert_bf16_copy_of_hf(tiny_hf / "hf", export)


def _sft(argv: list[str]) -> None:
    from megacispo.sft import main

    assert main(argv) == 0


def test_sft_starts_from_the_hf_directory(tiny_hf, tmp_path):
    """megacispo.sft --load HF (one process, bf16): one step at a negligible learning rate saves the
    HF weights, as megatron-to-hf shows."""
    from megacispo.checkpoint.to_hf import megatron_to_hf

    pairs = {"data.sft_pairs": tiny_hf / "train.parquet", "data.answer_key": "reward_model.ground_truth",
             "data.tokenizer": tiny_hf / "hf", "data.chat_template": "true", "train.run_dir": tmp_path / "run",
             "sft.steps": 1, "sft.batch_size": 4, "train.micro_batch_size": 4, "sft.lr": 1e-9,
             "precision.params_dtype": "bfloat16"}
    argv = ["--load", str(tiny_hf / "hf")]
    argv += [arg for key, value in pairs.items() for arg in ("--set", f"{key}={value}")]
    run_distributed(_sft, 1, argv, timeout_s=600)
    megatron_to_hf(tmp_path / "run" / "sft" / "checkpoints", tmp_path / "export", progress=False)
    _assert_bf16_copy_of_hf(tiny_hf / "hf", tmp_path / "export")


def test_failed_export_leaves_nothing(tiny_hf, trained, tmp_path):
    from megacispo.checkpoint.hf import export_hf

    class BrokenTokenizer:
        def save_files(self, directory):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        export_hf(trained["run_dir"] / "checkpoints" / "step_00000002", tmp_path / "export", BrokenTokenizer())
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Bad inputs: one error line, exit code 2, before any process group or model


def _broken_hf(source: Path, directory: Path, case: str) -> str:
    """A copy of the HF directory with one fault; returns what the error must name."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory)
    if case == "no_config":
        (directory / "config.json").unlink()
        return "config.json"
    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    name = "model.layers.1.self_attn.out_proj.weight"
    if case == "wrong_shape":
        tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 1)
    else:
        name = "model.layers.1.self_attn.extra_proj.weight"
        tensors[name] = torch.zeros(3, 3)
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("case", ["unknown_tensor", "wrong_shape", "no_config", "export_exists"])
def test_bad_hf_input_exits_before_any_model(tiny_hf, tmp_path, capsys, case):
    from megacispo.train import main

    hf_dir, export = tmp_path / "hf", tmp_path / "export"
    if case == "export_exists":
        hf_dir, named = tiny_hf / "hf", "train.export_hf"
        export.mkdir()
    else:
        named = _broken_hf(tiny_hf / "hf", hf_dir, case)
    one_process = ["--set", "parallel.expert_model_parallel_size=1"]
    with pytest.raises(SystemExit) as exit_info:
        main(_train_overrides(tiny_hf, tmp_path / "run", hf_dir, export) + one_process)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], lines
    assert "train." in lines[0], "the error names the config field"
    assert not torch.distributed.is_initialized() and not (tmp_path / "run").exists()
