"""kill -9 of a rank leaves no process of the run behind (issue #35): not Megatron-Core's Manager
process (started at the first checkpoint save), its resource tracker, nor the reward workers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megacispo.testing.rl_runs import run_overrides

REPO = Path(__file__).resolve().parents[2]
# How long the processes of a killed run may take to go: torchrun's own SIGTERM-then-SIGKILL of the
# surviving rank (30 s) and the reaper's SIGKILL of the killed rank's group.
GONE_WITHIN_S = 90


@pytest.mark.parametrize("rank", [0, 1])
def test_kill_9_of_a_rank_leaves_no_orphan(rank, task_files, tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "megacispo.train", *run_overrides(task_files, tmp_path / "run", steps=50)]
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
    finally:
        launcher.kill()
        launcher.wait()
