"""Weights & Biases as the MetricsLogger's second sink: the same keys and steps as TensorBoard, read
back from an offline run's own files, and the start-up error when logging.wandb asks for a package
that is not installed. The offline W&B run takes about 2 s to start and finish here."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from megacispo.config import Config
from megacispo.metrics.config import LoggingConfig
from megacispo.metrics.logger import (
    CONSUMED_SAMPLES_KEY,
    MetricsLogger,
    WandbSettings,
    check_logging,
    read_scalars,
)
from megacispo.startup import run_config

# The leveldb log format of W&B's run-<id>.wandb file: a 7-byte file header (":W&B", magic, version),
# then records in 32 KiB blocks, each with a 7-byte header (crc32c, length, kind); a record that
# crosses a block is split into FIRST, MIDDLE and LAST pieces. wandb 0.31 ships no Python reader.
_FILE_HEADER, _RECORD_HEADER, _BLOCK = 7, 7, 32 * 1024
_FULL, _LAST = 1, 4


def _wandb_records(path: Path) -> list:
    """Every protobuf Record of an offline W&B run file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    records, pending, offset = [], b"", _FILE_HEADER
    while offset + _RECORD_HEADER <= len(data):
        if _BLOCK - offset % _BLOCK < _RECORD_HEADER:  # a block's tail too short for a header is padding
            offset += _BLOCK - offset % _BLOCK
            continue
        length, kind = int.from_bytes(data[offset + 4:offset + 6], "little"), data[offset + 6]
        if offset + _RECORD_HEADER + length > len(data):  # still being written
            break
        pending += data[offset + _RECORD_HEADER:offset + _RECORD_HEADER + length]
        offset += _RECORD_HEADER + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _finished_records(run_file: Path, timeout_s: float = 30.0) -> list:
    """The run file's records once its last is the exit record: run.finish() returns before W&B's
    service has written the file out (seen empty right after finish here, one time in three)."""
    deadline = time.monotonic() + timeout_s
    while not (records := _wandb_records(run_file)) or records[-1].WhichOneof("record_type") != "exit":
        assert time.monotonic() < deadline, f"{run_file} has no exit record after {timeout_s} s"
        time.sleep(0.05)
    return records


def _wandb_history(run_dir: Path) -> tuple[list[dict[str, float]], object]:
    """(the history rows, the run record) of the one offline W&B run under ``run_dir/wandb``."""
    [run_file] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    records = _finished_records(run_file)
    rows = [{_item_key(item): json.loads(item.value_json) for item in record.history.item}
            for record in records if record.WhichOneof("record_type") == "history"]
    [run] = [record.run for record in records if record.WhichOneof("record_type") == "run"]
    return rows, run


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    """W&B offline and quiet, with its own settings and caches under tmp_path (nothing in $HOME)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home" / name.lower()))


STEPS = {
    1: {"loss/policy_loss": 0.25, "rollout/reward_mean": 0.5, "perf/tokens_per_s": 1000.0},
    2: {"loss/policy_loss": 0.125, "rollout/reward_mean": 0.75, "perf/tokens_per_s": 1500.0},
    3: {"loss/policy_loss": 0.0625, "rollout/reward_mean": 1.0, "perf/tokens_per_s": 2000.0},
}


def test_wandb_gets_the_same_keys_and_steps_as_tensorboard(wandb_offline, tmp_path):
    config = Config()
    config.train.run_dir = str(tmp_path / "my_run")
    config.logging = LoggingConfig(wandb=True, wandb_project="tests")
    with MetricsLogger.from_config(config, enabled=True) as logger:
        for step, metrics in STEPS.items():
            logger.log(step, metrics, consumed_samples=8 * step)

    run_dir = Path(config.train.run_dir)
    tensorboard = read_scalars(run_dir)
    rows, run = _wandb_history(run_dir)
    logged = {key: value for key, value in rows[0].items() if not key.startswith("_")}
    assert set(logged) == {key for key in tensorboard if not key.endswith("_vs_samples")} | {CONSUMED_SAMPLES_KEY}
    assert [row["_step"] for row in rows] == list(STEPS)
    for row, (step, metrics) in zip(rows, STEPS.items()):
        assert {key: row[key] for key in metrics} == metrics
        assert row[CONSUMED_SAMPLES_KEY] == 8 * step
        assert [value for logged_step, value in tensorboard["loss/policy_loss"] if logged_step == step] == [
            metrics["loss/policy_loss"]]
    assert run.display_name == "my_run", "an empty logging.wandb_run_name means train.run_dir's name"
    assert run.project == "tests"
    config_items = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config_items["logging"]["wandb_project"] == "tests", "the resolved config is the run's config"


def test_wandb_run_name_and_no_consumed_samples(wandb_offline, tmp_path):
    with MetricsLogger(tmp_path, enabled=True, console=False, wandb=WandbSettings("tests", "named")) as logger:
        logger.log(4, {"eval/accuracy": 0.5})
    rows, run = _wandb_history(tmp_path)
    assert run.display_name == "named"
    assert [(row["_step"], row["eval/accuracy"], CONSUMED_SAMPLES_KEY in row) for row in rows] == [(4, 0.5, False)]


def test_non_logging_rank_starts_no_wandb_run(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # importing it would fail
    with MetricsLogger(tmp_path, enabled=False, wandb=WandbSettings("tests", "x")) as logger:
        logger.log(1, {"loss/policy_loss": 1.0})
    assert not (tmp_path / "wandb").exists()


MISSING = r"logging.wandb = true but the wandb package is not installed: pip install -e \.\[wandb\]"


def test_missing_wandb_fails_at_start_up_naming_the_field_and_the_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)
    check_logging(LoggingConfig(wandb=False))  # not asked for: not needed
    with pytest.raises(ValueError, match=MISSING):
        check_logging(LoggingConfig(wandb=True))
    with pytest.raises(ValueError, match=MISSING):
        run_config(None, ["logging.wandb=true", f"train.run_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match=MISSING):
        MetricsLogger(tmp_path, enabled=True, wandb=WandbSettings("tests", "x"))


def test_empty_wandb_project_is_named():
    with pytest.raises(ValueError, match="logging.wandb_project is empty"):
        check_logging(LoggingConfig(wandb=True, wandb_project=""))
