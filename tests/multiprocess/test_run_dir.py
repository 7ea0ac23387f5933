"""A run's directory (issue #35): checked writable at start-up, locked by one run at a time (the lock
names its holder and is taken over once that holder is gone), a full disk named as such with the
failed save's files removed, stale temporaries freed when the next run starts, and --resume with
other prompts refused before anything is built.

The full-disk rows mount a small tmpfs (root only; skipped elsewhere)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megacispo.files import DirectoryInUse, check_writable_directory, lock_directory
from megacispo.testing.harness import run_distributed, run_entry_point
from megacispo.testing.rl_runs import run_overrides

REPO = Path(__file__).resolve().parents[2]
ONE_PROCESS = ["--set", "parallel.expert_model_parallel_size=1"]


def _entry(argv: list[str]) -> dict:
    return run_entry_point("megacispo.train", argv)


def _errors(result: dict) -> list[str]:
    return [line for line in result["err"].splitlines() if line.startswith("error: ")]


@contextlib.contextmanager
def _tmpfs(path: Path, size: str, *options: str):
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(path)],
                             capture_output=True, text=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}): needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


# ---------------------------------------------------------------------------------------------
# The lock
# ---------------------------------------------------------------------------------------------

_HOLD = """
import sys, time
from megacispo.files import lock_directory
lock = lock_directory(sys.argv[1], "train.run_dir")  # held while the object lives
print("held", flush=True)
time.sleep(300)
"""


def test_a_live_holder_is_named_and_a_dead_one_is_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(DirectoryInUse, match=rf"train.run_dir = {tmp_path} is in use by the run of PID "
                                                 rf"{holder.pid} on host .*, started .*: wait for that run to end"):
            lock_directory(tmp_path, "train.run_dir")
    finally:
        holder.kill()  # SIGKILL: the lock is never released by its holder
        holder.wait(timeout=30)
    lock = lock_directory(tmp_path, "train.run_dir")
    assert lock.previous_holder.startswith(f"the run of PID {holder.pid} on host ")
    lock.release()


# ---------------------------------------------------------------------------------------------
# Writability, at start-up
# ---------------------------------------------------------------------------------------------


def test_a_run_dir_that_is_a_file_or_below_one_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=rf"train.run_dir = {tmp_path / 'file'} is a file, not a directory"):
        check_writable_directory("train.run_dir", tmp_path / "file")
    with pytest.raises(ValueError, match=rf"is below {tmp_path / 'file'}, a file, not a directory"):
        check_writable_directory("train.run_dir", tmp_path / "file" / "run")
    check_writable_directory("train.run_dir", tmp_path / "new" / "run")


def test_a_read_only_run_dir_or_export_stops_train_at_start_up(tmp_path, task_files):
    with _tmpfs(tmp_path / "ro", "1m", "ro") as read_only:
        for field in ("train.run_dir", "train.export_hf"):
            argv = run_overrides(task_files, tmp_path / "run", steps=1) + ONE_PROCESS + [
                "--set", f"{field}={read_only / 'out'}", "--dry-run"]
            result = _entry(argv)
            assert result["code"] == 2, result["err"][-2000:]
            assert _errors(result) == [f"error: {field} = {read_only / 'out'} ({read_only}, where it would be made) "
                                       f"is not writable by this user: choose a directory you can write in, or change "
                                       f"its permissions"]


# ---------------------------------------------------------------------------------------------
# Full disks and temporaries
# ---------------------------------------------------------------------------------------------


def test_a_full_disk_is_named_and_the_failed_save_removed(tmp_path, task_files):
    with _tmpfs(tmp_path / "small", "2m") as small:
        argv = run_overrides(task_files, small / "run", steps=1) + ONE_PROCESS
        (result,) = run_distributed(_entry, 1, argv, timeout_s=300)
        assert result["code"] == 2, result["err"][-3000:]
        (error,) = _errors(result)
        assert "saving step 1 under" in error and "No space left on device" in error, error
        assert "its partial files were removed" in error and "Traceback" not in result["err"]
        assert not list((small / "run" / "checkpoints").glob(".tmp_*"))


def test_the_next_run_frees_what_an_interrupted_save_left_before_it_saves(tmp_path, task_files):
    """The disk holds the run's checkpoint only once the stale temporary directory is gone."""
    with _tmpfs(tmp_path / "disk", "24m") as disk:
        stale = disk / "run" / "checkpoints" / ".tmp_step_00000007"
        stale.mkdir(parents=True)
        (stale / "__0_0.distcp").write_bytes(bytes(16 * 1024**2))
        argv = run_overrides(task_files, disk / "run", steps=1) + ONE_PROCESS + ["--resume"]
        (result,) = run_distributed(_entry, 1, argv, timeout_s=300)
        assert result["code"] == 0, result["err"][-3000:]
        assert f"train.run_dir: removed {stale}, left by a save that did not finish" in result["out"]
        assert (disk / "run" / "checkpoints" / "step_00000001" / "meta.json").is_file()
        assert not stale.exists()


# ---------------------------------------------------------------------------------------------
# --resume with other prompts
# ---------------------------------------------------------------------------------------------


def test_resume_with_other_prompts_is_refused_before_anything_is_built(tmp_path, task_files):
    run_dir = tmp_path / "run"
    (trained,) = run_distributed(_entry, 1, run_overrides(task_files, run_dir, steps=1) + ONE_PROCESS, timeout_s=300)
    assert trained["code"] == 0, trained["err"][-3000:]
    other = tmp_path / "other.jsonl"
    shutil.copy(task_files / "test.jsonl", other)
    argv = run_overrides(task_files, run_dir, steps=2) + ONE_PROCESS + [
        "--set", f"data.train_prompts={other}", "--resume"]
    (result,) = run_distributed(_entry, 1, argv, timeout_s=300)
    assert result["code"] == 2, result["err"][-3000:]
    (error,) = _errors(result)
    meta = run_dir / "checkpoints" / "step_00000001" / "meta.json"
    assert error.startswith(f"error: --resume: {meta}: sampler state has num_records=64 but this sampler has "
                            f"num_records=8"), error
    assert "Traceback" not in result["err"]
