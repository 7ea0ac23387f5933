"""kill -9 of a rank leaves no process of the run behind (issue #35): not Megatron-Core's Manager
process (started at the first checkpoint save), its resource tracker, nor the reward workers; and the
checkpoints saved before it stay valid (issue #56: a rank killed mid-step, at EP 2 and at CP 2)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megacispo.checkpoint.distributed import verify_checkpoint
from megacispo.testing.rl_runs import run_overrides

REPO = Path(__file__).resolve().parents[2]
# How long the processes of a killed run may take to go: torchrun's own SIGTERM-then-SIGKILL of the
# surviving rank (30 s) and the reaper's SIGKILL of the killed rank's group.
GONE_WITHIN_S = 90


LAYOUTS = {"ep2": [],
           "cp2": ["--set", "parallel.expert_model_parallel_size=1", "--set", "parallel.context_parallel_size=2"]}


@pytest.mark.parametrize("layout, rank", [("ep2", 0), ("ep2", 1), ("cp2", 1)])
def test_kill_9_of_a_rank_leaves_no_orphan(layout, rank, task_files, tmp_path):
    """Killed in step 2 (or later), after step 1's save: every process of the run goes, the launcher
    fails, and each checkpoint on disk is a whole one."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "megacispo.train", *run_overrides(task_files, tmp_path / "run", steps=50), *LAYOUTS[layout]]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        # After the first save: Megatron-Core's writer has started its Manager process.
        while not (tmp_path / "run" / "checkpoints" / "step_00000001" / "meta.json").exists():
            assert launcher.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        tree = psutil.Process(launcher.pid).children(recursive=True)
        ranks = {int(p.environ()["RANK"]): p for p in psutil.Process(launcher.pid).children()}
        helpers = [p for p in tree if p not in ranks.values()]
        assert any("multiprocessing" in " ".join(p.cmdline()) for p in helpers), [p.cmdline() for p in helpers]
        ranks[rank].send_signal(signal.SIGKILL)
        _, alive = psutil.wait_procs(tree, timeout=GONE_WITHIN_S)
        assert not alive, [(p.pid, p.cmdline()) for p in alive]
        assert launcher.wait(timeout=GONE_WITHIN_S) != 0
        saved = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
        assert saved[0].name == "step_00000001"
        for checkpoint in saved:
            verify_checkpoint(checkpoint)
    finally:
        launcher.kill()
        launcher.wait()
