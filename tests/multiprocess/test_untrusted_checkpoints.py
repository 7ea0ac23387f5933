"""A checkpoint from someone else must never run code (issue #35): pickles planted where torch and
Megatron-Core unpickle a checkpoint are refused by every entry point that loads one, with one
``error:`` line naming the file, and nothing of them runs.

The payloads open a marker file for writing (what any code could do instead) and then give back
what the file held, as an attacker's would, with meta.json's recorded sizes edited to match:

- in torch DCP's index ``.metadata``, which torch's own reader unpickles with full pickle;
- in a shard's ``_extra_state`` byte record, which torch DCP's planner unpickles with full pickle;
- in common.pt, which torch.load reads weights-only by default (refused before anything is built).

Each test first shows that torch's own reading runs the payload, so that a refusal is the fix's.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import pickletools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from megacispo.checkpoint.unpickling import RefusedPickle, check_extra_state, read_dcp_metadata
from megacispo.testing.harness import run_distributed, run_entry_point
from megacispo.testing.rl_runs import run_overrides

REPO = Path(__file__).resolve().parents[2]
# How pickle names the payload's function (builtins.open is io.open).
OPEN = f"{open.__module__}.open"


class _OpensMarker:
    """Unpickled, it opens ``path`` for writing: the planted code."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _payload_then(marker: Path, real: bytes) -> bytes:
    """A pickle that runs the payload, drops its result, and then unpickles ``real`` (the payload
    leaves nothing in the memo, whose indices ``real`` counts from 0)."""
    return pickletools.optimize(pickle.dumps(_OpensMarker(marker), protocol=2))[:-1] + pickle.POP + real


def _record_sizes(step_dir: Path, *names: str) -> None:
    meta_path = step_dir / "meta.json"
    meta = json.loads(meta_path.read_text())
    for name in names:
        meta["files"][name] = (step_dir / name).stat().st_size
    meta_path.write_text(json.dumps(meta))


def _plant_in_index(step_dir: Path, marker: Path) -> Path:
    index = step_dir / ".metadata"
    index.write_bytes(_payload_then(marker, index.read_bytes()))
    _record_sizes(step_dir, ".metadata")
    return index


def _plant_in_byte_record(step_dir: Path, marker: Path) -> Path:
    """The first ``_extra_state`` record moved to the end of its shard as a torch.save of the payload."""
    index = step_dir / ".metadata"
    metadata = pickle.loads(index.read_bytes())  # the test's own file: full pickle is safe here
    key = next(key for key, value in metadata.state_dict_metadata.items() if isinstance(value, BytesStorageMetadata))
    storage_index = next(item for item in metadata.storage_data if item.fqn == key)
    info = metadata.storage_data[storage_index]
    shard = step_dir / info.relative_path
    blob = io.BytesIO()
    torch.save(_OpensMarker(marker), blob)
    offset = shard.stat().st_size
    with open(shard, "ab") as file:
        file.write(blob.getvalue())
    metadata.storage_data[storage_index] = dataclasses.replace(info, offset=offset, length=len(blob.getvalue()))
    index.write_bytes(pickle.dumps(metadata))
    _record_sizes(step_dir, ".metadata", info.relative_path)
    return shard


def _plant_in_common(step_dir: Path, marker: Path) -> Path:
    common = step_dir / "common.pt"
    torch.save({"payload": _OpensMarker(marker)}, common)
    _record_sizes(step_dir, "common.pt")
    return common


@pytest.fixture(scope="module")
def trained(task_files, tmp_path_factory) -> Path:
    """One step of the tiny model on 1 process, checkpointed: its step directory."""
    run_dir = tmp_path_factory.mktemp("untrusted") / "run"
    argv = run_overrides(task_files, run_dir, steps=1) + ["--set", "parallel.expert_model_parallel_size=1"]
    (result,) = run_distributed(run_entry_point, 1, "megacispo.train", argv, timeout_s=300)
    assert result["code"] == 0, result["err"][-3000:]
    return run_dir / "checkpoints" / "step_00000001"


def _copy(trained: Path, tmp_path: Path) -> Path:
    shutil.copytree(trained.parent, tmp_path / "checkpoints")
    return tmp_path / "checkpoints" / trained.name


def _train(task_files: Path, tmp_path: Path, *argv: str) -> list[str]:
    return run_overrides(task_files, tmp_path / "run", steps=1) + list(argv)


# Every entry point that loads a checkpoint: (module, argv for the checkpoint at step_dir, processes).
def _entry_points(task_files: Path, step_dir: Path, tmp_path: Path) -> dict[str, tuple[str, list[str], int]]:
    tokens = tmp_path / "tokens.jsonl"
    tokens.write_text(json.dumps({"tokens": [1, 5, 9, 2]}) + "\n")
    one_process = ["--set", "parallel.expert_model_parallel_size=1"]
    return {
        "train-load-1-process": ("megacispo.train", _train(task_files, tmp_path, *one_process, "--load", str(step_dir)),
                                 1),
        "train-load-2-processes": ("megacispo.train", _train(task_files, tmp_path, "--load", str(step_dir)), 2),
        "train-resume": ("megacispo.train", _train(task_files, tmp_path, *one_process, "--set",
                                                   f"train.run_dir={step_dir.parents[1]}", "--resume"), 1),
        "sft-load": ("megacispo.sft", _train(task_files, tmp_path, *one_process, "--set",
                                             f"data.sft_pairs={task_files / 'sft.jsonl'}", "--set",
                                             f"sft.load={step_dir}", "--set", f"sft.out={tmp_path / 'sft'}"), 1),
        "score": ("megacispo.score", ["--load", str(step_dir), "--tokens", str(tokens), "--out",
                                      str(tmp_path / "scores.jsonl")], 1),
        "eval": ("megacispo.eval", _train(task_files, tmp_path, *one_process, "--load", str(step_dir)), 1),
    }


def _assert_refused(results: list[dict], file: Path, marker: Path) -> None:
    assert [result["code"] for result in results] == [2] * len(results), results[0]["err"][-3000:]
    errors = [line for line in results[0]["err"].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"{file} is refused: loading it would call {OPEN}" in errors[0], \
        results[0]["err"][-3000:]
    assert "Traceback" not in results[0]["err"]
    assert all("error: " not in result["err"] for result in results[1:]), "another rank printed too"
    assert not marker.exists(), "the planted code ran"


ENTRY_POINTS = ["train-load-1-process", "train-load-2-processes", "train-resume", "sft-load", "score", "eval"]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_code_planted_in_the_index_is_refused_before_anything_is_built(entry, trained, task_files, tmp_path):
    step_dir = _copy(trained, tmp_path)
    marker = tmp_path / "ran"
    index = _plant_in_index(step_dir, marker)
    module, argv, processes = _entry_points(task_files, step_dir, tmp_path)[entry]
    results = run_distributed(run_entry_point, processes, module, argv, timeout_s=300)
    _assert_refused(results, index, marker)


def test_the_index_payload_runs_under_torchs_own_reader(trained, tmp_path):
    """What the tests above refuse is a working payload: torch DCP's reader runs it and reads on."""
    step_dir = _copy(trained, tmp_path)
    marker = tmp_path / "ran"
    _plant_in_index(step_dir, marker)
    assert FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    assert marker.exists()


def test_code_planted_in_the_index_is_refused_by_the_converter(trained, tmp_path):
    step_dir = _copy(trained, tmp_path)
    marker = tmp_path / "ran"
    index = _plant_in_index(step_dir, marker)
    result = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "megatron-to-hf", "--ckpt", str(step_dir),
                             "--out", str(tmp_path / "hf"), "--no-progress"], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    _assert_refused([{"code": result.returncode, "err": result.stderr}], index, marker)
    assert not (tmp_path / "hf").exists()


# The 2-process row in the slow tier: CI's index test has its 2-process row (every rank exits with the code).
@pytest.mark.parametrize("entry", ["train-load-1-process", pytest.param("train-load-2-processes", marks=pytest.mark.slow),
                                   "score"])
def test_code_planted_in_a_byte_record_is_refused_when_it_loads(entry, trained, task_files, tmp_path):
    step_dir = _copy(trained, tmp_path)
    marker = tmp_path / "ran"
    shard = _plant_in_byte_record(step_dir, marker)
    module, argv, processes = _entry_points(task_files, step_dir, tmp_path)[entry]
    results = run_distributed(run_entry_point, processes, module, argv, timeout_s=300)
    assert [result["code"] for result in results] == [2] * processes, results[0]["err"][-3000:]
    errors = [line for line in results[0]["err"].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"{shard}, record " in errors[0] and f"would call {OPEN}" in errors[0], \
        results[0]["err"][-3000:]
    assert not marker.exists(), "the planted code ran"


def test_code_planted_in_common_pt_is_one_error_line(trained, task_files, tmp_path):
    step_dir = _copy(trained, tmp_path)
    marker = tmp_path / "ran"
    common = _plant_in_common(step_dir, marker)
    module, argv, processes = _entry_points(task_files, step_dir, tmp_path)["train-load-1-process"]
    results = run_distributed(run_entry_point, processes, module, argv, timeout_s=300)
    _assert_refused(results, common, marker)


# ---------------------------------------------------------------------------------------------
# The allow-lists themselves
# ---------------------------------------------------------------------------------------------


def test_the_index_reader_reads_what_torch_wrote(trained):
    ours = read_dcp_metadata(trained / ".metadata")
    torchs = FileSystemReader(str(trained)).read_metadata()
    assert ours.state_dict_metadata == torchs.state_dict_metadata
    assert ours.storage_data == torchs.storage_data


def _te_state(**extra) -> torch.Tensor:
    """Transformer Engine's FP8 extra state as its get_extra_state makes it: pickle.dumps in a uint8 tensor."""
    state = {"scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(4, 3)[:, 1],
             "extra_fp8_variables": {"num_gemms": 3, "fp8_max_fwd": 448.0}, **extra}
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


class _StorageFromBytes:
    """Unpickled, it is torch.storage._load_from_bytes(data), as a pickled tensor's storage is."""

    def __init__(self, data: bytes):
        self.data = data

    def __reduce__(self):
        return torch.storage._load_from_bytes, (self.data,)


def test_transformer_engine_state_passes_and_a_payload_in_it_is_refused(tmp_path):
    check_extra_state([_te_state(), None])
    marker = tmp_path / "ran"
    with pytest.raises(RefusedPickle, match=OPEN):
        check_extra_state([_te_state(recipe=_OpensMarker(marker))])
    planted_storage = io.BytesIO()
    torch.save(_OpensMarker(marker), planted_storage)
    with pytest.raises(RefusedPickle, match=OPEN):
        check_extra_state(_te_state(scale_bwd=_StorageFromBytes(planted_storage.getvalue())))
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# Non-finite weights in a megacispo checkpoint
# ---------------------------------------------------------------------------------------------

NAN_TENSOR = "decoder.layers.0.self_attention.out_proj.weight"


def _save_with_nan(step_dir: str, root: str) -> None:
    from megacispo.checkpoint.distributed import save_checkpoint
    from megacispo.testing.checkpoints import load_single_process

    model, _, meta = load_single_process(step_dir)
    with torch.no_grad():
        dict(model.named_parameters())[NAN_TENSOR].view(-1)[3] = float("nan")
    save_checkpoint(root, meta["step"], model, config_dict=meta["config"])


# Slow tier (CI stays under 20 minutes on 2 cores): 15-30 s; what it covers runs in CI in a cheaper form.
@pytest.mark.slow
def test_a_nan_weight_is_named_by_train_and_the_converter(trained, task_files, tmp_path):
    run_distributed(_save_with_nan, 1, str(trained), str(tmp_path / "nan"), timeout_s=300)
    step_dir = tmp_path / "nan" / trained.name
    module, argv, processes = _entry_points(task_files, step_dir, tmp_path)["train-load-2-processes"]
    results = run_distributed(run_entry_point, processes, module, argv, timeout_s=300)
    assert [result["code"] for result in results] == [2, 2], results[0]["err"][-3000:]
    errors = [line for line in results[0]["err"].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"tensor {NAN_TENSOR} in {step_dir} is not finite" in errors[0], errors
    converted = subprocess.run([sys.executable, "tools/convert_checkpoint.py", "megatron-to-hf", "--ckpt",
                                str(step_dir), "--out", str(tmp_path / "hf"), "--no-progress"], cwd=REPO,
                               capture_output=True, text=True, timeout=300,
                               env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert converted.returncode == 2, converted.stderr[-3000:]
    assert f"tensor {NAN_TENSOR} in {step_dir} is not finite" in converted.stderr
    assert not (tmp_path / "hf").exists()
