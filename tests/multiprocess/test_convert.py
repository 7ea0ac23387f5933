"""Checkpoint conversion (megacispo.checkpoint.to_megatron and to_hf, the streaming converter behind tools/convert_checkpoint.py)
and scoring (megacispo.score) against Hugging Face transformers: a tiny random MiniMaxForCausalLM
(MODEL.md's config, large random weights) is saved with save_pretrained, converted to a megacispo
checkpoint, scored at TP = 1 (EP = 1 and EP = 2), TP = 2 (sequence parallel, straight from the HF
directory: megacispo.checkpoint.hf.load_hf_weights) and PP = 2, and the per-token log-probs
equal transformers' to 1e-4 (fp32). The round trip HF -> megatron -> HF gives bit-identical tensors
that transformers loads; the fused expert layout (sharded, with an index) converts to the same
checkpoint; the converted checkpoint has the files, keys, shapes, dtypes and chunks that
megacispo.checkpoint.distributed.save_checkpoint writes; neither direction ever holds more than 3x the
largest tensor's bytes (TensorMeter); broken inputs fail naming the tensor and the file and leave
nothing behind.

rotary_dim = head_dim because HF rotates whole heads (megacispo.testing.hf_models.hf_config).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megacispo.testing.harness import run_distributed
from megacispo.testing.hf_models import SEQUENCES, hf_logprobs, hf_model

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

TOLERANCE = 1e-4
DERIVED = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


# The converter may hold at most this many times the largest tensor's bytes at once.
MAX_TENSORS_HELD = 3


def _write_fused_sharded(model, directory: Path) -> None:
    """The fused (in-memory) expert layout, split into two shards listed by an index."""
    from safetensors.torch import save_file

    directory.mkdir()
    model.config.to_json_file(directory / "config.json")
    state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
    names = sorted(state)
    weight_map = {}
    for number, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        file_name = f"model-{number + 1:05d}-of-00002.safetensors"
        save_file({name: state[name] for name in part}, str(directory / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert")
    model = hf_model()
    model.save_pretrained(root / "hf_legacy")
    _write_fused_sharded(model, root / "hf_fused")
    (root / "tokens.jsonl").write_text("".join(json.dumps({"tokens": t, "id": i}) + "\n" for i, t in enumerate(SEQUENCES)))
    return {"root": root, "hf_logprobs": hf_logprobs(model), "hf_model": model}


# ---------------------------------------------------------------------------------------------
# Conversion, in one process


def _broken_copies(root: Path) -> dict[str, tuple[Path, str, str]]:
    """name -> (HF dir, the tensor and the file the error must name)."""
    from safetensors.torch import load_file, save_file

    broken = {}
    missing = root / "missing_shard"
    shutil.copytree(root / "hf_fused", missing)
    (missing / "model-00002-of-00002.safetensors").unlink()
    index = json.loads((missing / "model.safetensors.index.json").read_text())
    first_lost = next(n for n, f in sorted(index["weight_map"].items()) if f == "model-00002-of-00002.safetensors")
    broken["missing_shard"] = (missing, first_lost, "model-00002-of-00002.safetensors")
    for name, change in (("wrong_shape", "model.layers.3.self_attn.out_proj.weight"),
                         ("unknown_key", "model.layers.2.self_attn.extra_proj.weight")):
        directory = root / name
        shutil.copytree(root / "hf_legacy", directory)
        tensors = load_file(str(directory / "model.safetensors"))
        if name == "wrong_shape":
            tensors[change] = torch.zeros(tensors[change].shape[0], tensors[change].shape[1] + 1)
        else:
            tensors[change] = torch.zeros(3, 3)
        save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
        broken[name] = (directory, change, "model.safetensors")
    return broken


def _storage_layout(step_dir: Path) -> dict:
    """What a torch_dist directory stores: each key's size, dtype and chunks (offsets, sizes), or
    None for byte objects."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    layout = {}
    for key, value in FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata.items():
        if isinstance(value, TensorStorageMetadata):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in value.chunks)
            layout[key] = (tuple(value.size), value.properties.dtype, chunks)
        else:
            layout[key] = None
    return layout


def _convert_all(root: str) -> dict:
    from megacispo.checkpoint.distributed import save_checkpoint
    from megacispo.checkpoint.streaming import TensorMeter
    from megacispo.checkpoint.to_hf import megatron_to_hf
    from megacispo.checkpoint.to_megatron import hf_to_megatron
    from megacispo.testing.checkpoints import full_tensors, load_single_process

    root = Path(root)
    meters = {name: TensorMeter() for name in ("legacy", "fused", "to_hf")}
    hf_to_megatron(root / "hf_legacy", root / "ckpt_legacy", ep=2, progress=False, meter=meters["legacy"])
    hf_to_megatron(root / "hf_fused", root / "ckpt_fused", progress=False, meter=meters["fused"])
    megatron_to_hf(root / "ckpt_legacy", root / "hf_back", max_shard_bytes=1_000_000, progress=False,
                           meter=meters["to_hf"])
    full = {name: full_tensors(load_single_process(root / name)[0]) for name in ("ckpt_legacy", "ckpt_fused")}
    # The same weights saved the way training saves them, for the layout comparison.
    model = load_single_process(root / "ckpt_legacy")[0]
    saved = save_checkpoint(root / "ckpt_saved", 0, model, keep_last=None)
    files = {
        name: sorted(p.name for p in path.iterdir() if p.is_file())
        for name, path in (("converted", root / "ckpt_legacy" / "step_00000000"), ("saved", saved))
    }
    layouts = {"converted": _storage_layout(root / "ckpt_legacy" / "step_00000000"), "saved": _storage_layout(saved)}
    memory = {name: {"peak": m.peak_bytes, "largest": m.largest_bytes, "live_after": m.live_bytes}
              for name, m in meters.items()}
    errors = {}
    for name, (directory, tensor_name, file_name) in _broken_copies(root).items():
        out = root / f"out_{name}"
        try:
            hf_to_megatron(directory, out, progress=False)
        except ValueError as error:
            errors[name] = {"message": str(error), "tensor": tensor_name, "file": file_name, "out_exists": out.exists()}
        leftovers = [p.name for p in root.iterdir() if p.name.startswith(f".tmp_out_{name}")]
        errors.setdefault(name, {"message": None})["leftovers"] = leftovers
    return {"full": full, "errors": errors, "memory": memory, "files": files, "layouts": layouts}


@pytest.fixture(scope="module")
def converted(workspace):
    (result,) = run_distributed(_convert_all, 1, str(workspace["root"]))
    return result


def test_round_trip_is_bit_identical(workspace, converted):
    from safetensors.torch import load_file

    root = workspace["root"]
    original = load_file(str(root / "hf_legacy" / "model.safetensors"))
    index = json.loads((root / "hf_back" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1, "max_shard_bytes must split the tiny model"
    back = {}
    for file_name in files:
        back.update(load_file(str(root / "hf_back" / file_name)))
    assert back.keys() == {name for name in original if not name.endswith(DERIVED)}
    for name, tensor in back.items():
        assert tensor.dtype == original[name].dtype and torch.equal(tensor, original[name]), name


def test_transformers_loads_the_round_trip(workspace, converted):
    from transformers import MiniMaxForCausalLM

    reloaded = MiniMaxForCausalLM.from_pretrained(workspace["root"] / "hf_back").eval()
    ids = torch.tensor(SEQUENCES[2])[None]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, workspace["hf_model"](ids).logits, rtol=0, atol=0)


def test_both_expert_layouts_give_the_same_checkpoint(converted):
    legacy, fused = converted["full"]["ckpt_legacy"], converted["full"]["ckpt_fused"]
    assert legacy.keys() == fused.keys()
    for key in legacy:
        assert torch.equal(legacy[key], fused[key]), key


def test_conversion_records_the_layout(workspace, converted):
    from megacispo.checkpoint.distributed import read_meta

    meta = read_meta(workspace["root"] / "ckpt_legacy" / "step_00000000")
    assert meta["config"]["parallel"]["expert_model_parallel_size"] == 2
    assert meta["config"]["model"]["rotary_dim"] == meta["config"]["model"]["head_dim"] == 32
    assert meta["extra_state"]["hf_experts_layout"] == "legacy"


@pytest.mark.parametrize("case", ["missing_shard", "wrong_shape", "unknown_key"])
def test_broken_input_names_tensor_and_file_and_leaves_nothing(converted, case):
    error = converted["errors"][case]
    assert error["message"] is not None, f"{case}: no ValueError"
    assert error["tensor"] in error["message"] and error["file"] in error["message"], error["message"]
    assert not error["out_exists"] and error["leftovers"] == []


def test_existing_output_is_refused(workspace, converted):
    from megacispo.checkpoint.to_megatron import hf_to_megatron

    with pytest.raises(ValueError, match="already exists"):
        hf_to_megatron(workspace["root"] / "hf_legacy", workspace["root"] / "ckpt_legacy")


def test_converted_checkpoint_is_laid_out_as_training_saves_it(converted):
    """Same Megatron files and the same stored keys, global shapes, dtypes and chunks as
    save_checkpoint (the converted checkpoint has no rng/ and merges its parts' .distcp files)."""
    files, layouts = converted["files"], converted["layouts"]
    def megatron_files(names):
        return [n for n in names if not n.endswith(".distcp")]
    assert megatron_files(files["converted"]) == megatron_files(files["saved"]) == [
        ".metadata", "common.pt", "meta.json", "metadata.json"]
    assert layouts["converted"] == layouts["saved"]


@pytest.mark.parametrize("direction", ["legacy", "fused", "to_hf"])
def test_conversion_holds_a_few_tensors_not_the_model(workspace, converted, direction):
    """The bytes of the tensors the converter holds at once (TensorMeter: every tensor it reads,
    until freed, including those the writers keep) stay within MAX_TENSORS_HELD x the largest
    tensor (of the on-disk HF layout: one matrix per expert), far below the model's size, and
    nothing stays alive after the conversion."""
    from safetensors.torch import load_file

    on_disk = load_file(str(workspace["root"] / "hf_legacy" / "model.safetensors"))
    largest = max(t.numel() * t.element_size() for t in on_disk.values())
    model_bytes = sum(t.numel() * t.element_size() for t in on_disk.values())
    assert model_bytes > 4 * MAX_TENSORS_HELD * largest, "the test model must tell streaming from loading it whole"
    memory = converted["memory"][direction]
    assert memory["largest"] == largest, "the embedding and LM head are the largest tensors; both are read"
    assert 0 < memory["peak"] <= MAX_TENSORS_HELD * largest, memory
    assert memory["live_after"] == 0


# ---------------------------------------------------------------------------------------------
# Scoring, in two processes


def _score_all(root: str) -> None:
    from megacispo import score

    root = Path(root)
    tokens = str(root / "tokens.jsonl")
    score.run(["--load", str(root / "ckpt_legacy"), "--tokens", tokens, "--out", str(root / "scored_ep2.jsonl"),
               "--set", "parallel.expert_model_parallel_size=2"])
    score.run(["--load", str(root / "ckpt_fused" / "step_00000000"), "--tokens", tokens,
               "--out", str(root / "scored_dp2.jsonl")])
    score.run(["--load", str(root / "hf_legacy"), "--tokens", tokens, "--out", str(root / "scored_tp2.jsonl"),
               "--set", "parallel.tensor_model_parallel_size=2"])
    score.run(["--load", str(root / "ckpt_legacy"), "--tokens", tokens, "--out", str(root / "scored_pp2.jsonl"),
               "--set", "parallel.pipeline_model_parallel_size=2"])


@pytest.fixture(scope="module")
def scored(workspace, converted):
    root = workspace["root"]
    run_distributed(_score_all, 2, str(root))
    return {
        name: [json.loads(line) for line in (root / f"scored_{name}.jsonl").read_text().splitlines()]
        for name in ("ep2", "dp2", "tp2", "pp2")
    }


@pytest.mark.parametrize("layout", ["ep2", "dp2", "tp2", "pp2"])
def test_scores_equal_transformers(workspace, scored, layout):
    records = scored[layout]
    assert [r["id"] for r in records] == list(range(len(SEQUENCES)))
    for record, tokens, reference in zip(records, SEQUENCES, workspace["hf_logprobs"]):
        assert record["tokens"] == tokens
        assert len(record["logprobs"]) == len(tokens) - 1
        torch.testing.assert_close(torch.tensor(record["logprobs"], dtype=torch.float64), reference,
                                   rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize(("args", "message"), [
    (["--set", "parallel.pipeline_model_parallel_size=3"], r"context_parallel_size = 1 \* 3 \* 1 = 3"),
    (["--set", "parallel.tensor_model_parallel_size=3"], r"context_parallel_size = 3 \* 1 \* 1 = 3"),
])
def test_score_refuses_bad_layout_before_work(workspace, converted, args, message):
    from megacispo import score

    root = workspace["root"]
    with pytest.raises(SystemExit, match=message):
        score.run(["--load", str(root / "ckpt_legacy"), "--tokens", str(root / "tokens.jsonl"),
                   "--out", str(root / "never.jsonl"), *args])


def test_score_refuses_token_outside_vocabulary(workspace, converted, tmp_path):
    from megacispo import score

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2]}\n{"tokens": [3, 512]}\n')
    with pytest.raises(SystemExit, match="line 2: token id 512"):
        score.run(["--load", str(workspace["root"] / "ckpt_legacy"), "--tokens", str(bad),
                   "--out", str(tmp_path / "never.jsonl")])
