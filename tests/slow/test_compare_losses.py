"""examples/compare_losses.sh end to end on the addition task with every loss, rerun to check that
finished runs are kept (tests/multiprocess/test_compare_losses.py runs the fork task with the same script)."""

from __future__ import annotations

from megacispo.rl.losses import get_policy_loss
from megacispo.testing.loss_comparison import LOSSES, PNG_SIGNATURE, run_config, run_script, script_env, table_rows


def test_compare_losses_script_makes_the_plot_and_table_for_every_loss(tmp_path):
    """The addition task with every loss (in the slow tier: the fork test runs the same script)."""
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
