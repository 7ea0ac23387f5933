"""examples/compare_losses.sh end to end at tiny sizes: the addition task with every loss, rerun to
check that finished runs are kept; its fork task (TASK=fork) followed by examples/compare_adaptive_clip.sh
on the same runs. The table logic on hand-made series: tests/multiprocess/test_compare_losses.py."""

from __future__ import annotations

import subprocess

from megacispo.rl.losses import get_policy_loss
from megacispo.testing.loss_comparison import (
    LOSSES,
    PNG_SIGNATURE,
    REPO,
    run_config,
    run_script,
    script_env,
    table_rows,
)


def test_compare_losses_script_makes_the_plot_and_table_for_every_loss(tmp_path):
    """The addition task with every loss."""
    run_dir = tmp_path / "compare"
    env = script_env(run_dir, "--set rollout.max_new_tokens=4", UPDATES="2")
    run_script(env, tmp_path)
    png = run_dir / "compare_u2.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 10_000
    rows = table_rows((run_dir / "table.md").read_text().split("\n\n")[0])
    assert list(rows) == [f"{loss}_u2" for loss in LOSSES]
    assert all(row["runs"] == "1" for row in rows.values())
    for loss in LOSSES:
        # Each run trained with its own loss at the registry's (paper) parameters.
        config = run_config(run_dir / f"{loss}_u2_seed0")
        assert config["rl"]["loss"]["name"] == loss and config["train"]["seed"] == 0
        assert config["rl"]["loss"]["params"] == get_policy_loss(loss).param_defaults
        assert config["rl"]["updates_per_rollout"] == 2 and config["train"]["micro_batch_size"] == 4
    # Run again: every finished run is kept, only the plot and table are made anew.
    png.unlink()
    again = run_script(env, tmp_path)
    assert [f"kept {loss}_u2_seed0" in again for loss in LOSSES] == [True] * len(LOSSES)
    assert "   start " not in again and "== shared SFT" not in again and "== task data" not in again
    assert png.read_bytes()[:8] == PNG_SIGNATURE


def test_fork_comparison_then_the_adaptive_clip_comparison_on_its_runs(tmp_path):
    """TASK=fork: the branch measurement of the SFT start, the probe's metrics, two arms at two
    updates-per-rollout values and the sweep figure; then examples/compare_adaptive_clip.sh on the
    same directory: the fixed caps and the adaptive targets as arms, the plain cispo run and the SFT
    start kept, the adapted bound logged and moving."""
    from megacispo.metrics.logger import read_scalars

    run_dir = tmp_path / "fork"
    env = script_env(run_dir, TASK="fork", ARMS="cispo dapo", UPDATES="1 2")
    run_script(env, tmp_path)
    branches = (run_dir / "branches.txt").read_text()
    assert "worked branch accuracy" in branches and "marker probability at the response's start" in branches
    rows = table_rows((run_dir / "table.md").read_text().split("\n\n")[0])
    assert list(rows) == ["cispo_u1", "dapo_u1", "cispo_u2", "dapo_u2"]
    assert "marker clipped high" in next(iter(rows.values()))
    for name in ("compare_u1.png", "compare_u2.png", "sweep.png"):
        assert (run_dir / name).read_bytes()[:8] == PNG_SIGNATURE, name
    config = run_config(run_dir / "dapo_u2_seed0")
    assert config["rl"]["loss"]["name"] == "dapo" and config["rl"]["loss"]["params"] == get_policy_loss("dapo").param_defaults
    assert config["rl"]["reward"] == "numeric" and config["logging"]["metric_hooks"] == {"probe_token": {"token": "~"}}
    start_prob = read_scalars(run_dir / "dapo_u1_seed0")["probe/start_prob"]
    assert [step for step, _ in start_prob] == [1, 2] and all(0 < value < 1 for _, value in start_prob)

    env.update(TASKS="fork", UPDATES="2")
    del env["ARMS"], env["TASK"]
    result = subprocess.run(["bash", str(REPO / "examples" / "compare_adaptive_clip.sh")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "kept cispo_u2_seed0" in result.stdout
    assert not any(stage in result.stdout for stage in ("== task data", "== shared SFT", "== the fork on the SFT"))
    rows = table_rows((run_dir / "adaptive_clip" / "table.md").read_text().split("\n\n")[0])
    assert list(rows) == [f"{arm}_u2" for arm in ("cispo_cap1.2", "cispo_cap2", "cispo", "cispo_cap8",
                                                  "cispo_target0.001", "cispo_target0.01")]
    assert (run_dir / "adaptive_clip" / "compare_u2.png").read_bytes()[:8] == PNG_SIGNATURE
    assert run_config(run_dir / "cispo_cap1.2_u2_seed0")["rl"]["loss"]["params"]["eps_high"] == 0.2
    assert run_config(run_dir / "cispo_target0.01_u2_seed0")["rl"]["adaptive_clip"]["target_capped_frac"] == 0.01
    bound = [value for _, value in read_scalars(run_dir / "cispo_target0.01_u2_seed0")["loss/eps_high_current"]]
    assert len(bound) == 2 and bound[0] != bound[1] != 4.0
