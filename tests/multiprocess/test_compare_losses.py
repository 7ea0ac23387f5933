"""The loss comparison tooling: the table logic of tools/plot_runs.py on hand-made series (steps to
reach a level, ratios, runs that never reach it, final accuracy, clip fractions), its errors on bad
input, the PNG and table from logged runs. examples/compare_losses.sh and compare_adaptive_clip.sh end
to end: tests/slow/test_compare_losses.py."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from megacispo.metrics.logger import MetricsLogger
from megacispo.testing.loss_comparison import PNG_SIGNATURE, table_rows
from megacispo.testing.tool_modules import load_tool

plot_runs = load_tool("plot_runs")


def _run(accuracy, clip_high=0.0, clip_low=0.0, mask=0.0, steps=4):
    """A run's scalars as read_scalars returns them: accuracy at the given steps, per-step fractions."""
    per_step = range(1, steps + 1)
    return {
        "eval/accuracy": list(accuracy),
        "loss/clip_frac_high": [(step, clip_high) for step in per_step],
        "loss/clip_frac_low": [(step, clip_low) for step in per_step],
        "loss/mask_frac": [(step, mask) for step in per_step],
    }


# ---------------------------------------------------------------------------------------------
# Table logic on hand-made series
# ---------------------------------------------------------------------------------------------


def test_steps_to_reach_is_the_first_step_at_or_above_the_level_in_step_order():
    accuracy = [(8, 0.6), (0, 0.1), (4, 0.3), (12, 0.2)]  # out of order, and dips after reaching
    assert plot_runs.steps_to_reach(accuracy, 0.3) == 4  # equality counts
    assert plot_runs.steps_to_reach(accuracy, 0.31) == 8
    assert plot_runs.steps_to_reach(accuracy, 0.05) == 0  # reached at the SFT start
    assert plot_runs.steps_to_reach(accuracy, 0.61) is None
    assert plot_runs.steps_to_reach([], 0.1) is None


def test_level_mean_needs_every_run_and_the_ratio_divides_by_the_reference():
    reached = plot_runs.level_result([[(0, 0.0), (4, 0.5)], [(0, 0.0), (4, 0.1), (8, 0.5), (12, 0.5)]], 0.5)
    assert reached.steps == (4, 8) and reached.num_reached == 2
    assert reached.mean_steps == pytest.approx(6.0)
    partly = plot_runs.level_result([[(0, 0.0), (4, 0.5)], [(0, 0.0), (4, 0.4)]], 0.5)
    assert partly.steps == (4, None) and partly.num_reached == 1 and partly.mean_steps is None
    reference = plot_runs.level_result([[(0, 0.0), (4, 0.5)]], 0.5)
    assert plot_runs.speed_ratio(reached, reference) == pytest.approx(1.5)
    assert plot_runs.speed_ratio(partly, reference) is None
    assert plot_runs.speed_ratio(reached, partly) is None
    assert plot_runs.speed_ratio(reached, None) is None
    at_start = plot_runs.level_result([[(0, 0.6)]], 0.5)  # a 0-step reference has no ratio
    assert at_start.mean_steps == 0 and plot_runs.speed_ratio(reached, at_start) is None


def test_comparison_table_cells_against_values_computed_by_hand():
    runs_by_group = {
        "cispo": [_run([(0, 0.1), (4, 0.3), (8, 0.5)], clip_high=0.02, clip_low=0.0),
                  _run([(0, 0.1), (4, 0.2), (8, 0.3), (12, 0.6)], clip_high=0.04, clip_low=0.0)],
        "dapo": [_run([(0, 0.1), (4, 0.2), (8, 0.3), (12, 0.4)], clip_high=0.10, clip_low=0.05, mask=0.0),
                 _run([(0, 0.1), (4, 0.2), (8, 0.2), (12, 0.3)], clip_high=0.20, clip_low=0.15)],
        "reinforce": [_run([(0, 0.1), (8, 0.3)])],
    }
    runs_by_group["reinforce"][0].pop("loss/mask_frac")  # a run without the tag: no masked cell
    rows = table_rows(plot_runs.comparison_table(runs_by_group, levels=[0.3, 0.5], reference="cispo"))
    assert list(rows) == ["cispo", "dapo", "reinforce"]
    level_03, level_05 = "steps to 0.3 (x cispo)", "steps to 0.5 (x cispo)"
    # cispo reaches 0.3 at steps 4 and 8 (mean 6), 0.5 at 8 and 12 (mean 10).
    assert rows["cispo"][level_03] == "6.0 [4-8] (x1.00)" and rows["cispo"][level_05] == "10.0 [8-12] (x1.00)"
    # dapo: 0.3 at 8 and 12 -> 10 / 6; 0.5 never.
    assert rows["dapo"][level_03] == f"10.0 [8-12] (x{10 / 6:.2f})"
    assert rows["dapo"][level_05] == "not reached (0/2)"
    assert rows["reinforce"][level_03] == f"8.0 [8-8] (x{8 / 6:.2f})" and rows["reinforce"]["runs"] == "1"
    assert rows["cispo"]["final accuracy"] == f"{0.55:.3f} +- {statistics.stdev([0.5, 0.6]):.3f}"
    assert rows["dapo"]["final accuracy"] == f"{0.35:.3f} +- {statistics.stdev([0.4, 0.3]):.3f}"
    assert rows["reinforce"]["final accuracy"] == "0.300 +- 0.000"
    assert rows["cispo"]["clipped high"] == "3.00%" and rows["cispo"]["clipped low"] == "0.00%"
    assert rows["dapo"]["clipped high"] == "15.00%" and rows["dapo"]["clipped low"] == "10.00%"
    assert rows["dapo"]["masked"] == "0.00%" and rows["reinforce"]["masked"] == "-"


def test_a_reference_that_is_not_reached_or_absent_gives_no_ratio():
    runs_by_group = {"cispo": [_run([(0, 0.1), (4, 0.2)])], "dapo": [_run([(0, 0.1), (4, 0.4)])]}
    rows = table_rows(plot_runs.comparison_table(runs_by_group, levels=[0.3], reference="cispo"))
    assert rows["cispo"]["steps to 0.3 (x cispo)"] == "not reached (0/1)"
    assert rows["dapo"]["steps to 0.3 (x cispo)"] == "4.0 [4-4]"
    rows = table_rows(plot_runs.comparison_table(runs_by_group, levels=[0.3], reference="grpo"))
    assert rows["dapo"]["steps to 0.3 (x grpo)"] == "4.0 [4-4]"


def test_mean_and_band_over_runs_use_the_runs_that_logged_each_step():
    steps, mean, low, high = plot_runs.aggregate_over_runs([
        [(1, 1.0), (2, 2.0), (3, 3.0)],
        [(1, 3.0), (2, 5.0), (2, 4.0)],  # step 2 logged twice (a resumed run): the last value counts
    ])
    assert steps == [1, 2, 3]
    assert mean == pytest.approx([2.0, 3.0, 3.0])
    assert low == [1.0, 2.0, 3.0] and high == [3.0, 4.0, 3.0]
    assert plot_runs.final_values([[(2, 0.5), (1, 0.9), (2, 0.3)], [(0, 0.1)]]) == [0.3, 0.1]


def test_runs_group_by_the_name_without_the_seed_suffix_or_a_given_regex():
    dirs = [Path("r/cispo_seed0"), Path("r/dapo_seed0"), Path("r/cispo_seed12"), Path("r/baseline")]
    assert plot_runs.group_runs(dirs) == {
        "cispo": [dirs[0], dirs[2]], "dapo": [dirs[1]], "baseline": [dirs[3]],
    }
    assert plot_runs.group_runs([Path("lr1e-4-cispo-s1"), Path("lr1e-4-cispo-s2")], r"-(\w+)-s\d+$") == {
        "cispo": [Path("lr1e-4-cispo-s1"), Path("lr1e-4-cispo-s2")],
    }
    with pytest.raises(ValueError, match=r"does not match the run directory name 'baseline'"):
        plot_runs.group_runs(dirs, r"^(\w+)_seed\d+$")
    with pytest.raises(ValueError, match="has no capture group"):
        plot_runs.group_runs(dirs, r"_seed\d+$")


# ---------------------------------------------------------------------------------------------
# Reading runs, errors, the PNG
# ---------------------------------------------------------------------------------------------


def _log_run(run_dir: Path, accuracy: list[float], skip: tuple[str, ...] = ()) -> None:
    """Write a run's events as the trainer does: eval/accuracy at steps 0, 2, 4..., the rest per step."""
    values = {"rollout/reward_mean": 0.2, "loss/entropy": 1.5, "loss/clip_frac_high": 0.01,
              "loss/clip_frac_low": 0.002, "loss/mask_frac": 0.0}
    with MetricsLogger(run_dir, enabled=True, console=False) as logger:
        for index, value in enumerate(accuracy):
            step = 2 * index
            if step:
                logger.log(step - 1, {k: v for k, v in values.items() if k not in skip})
                logger.log(step, {k: v + 0.01 * step for k, v in values.items() if k not in skip})
            logger.log(step, {"eval/accuracy": value})


def test_bad_run_directories_fail_with_the_directory_and_tag_named(tmp_path, capsys):
    out = tmp_path / "compare.png"
    assert plot_runs.main([str(tmp_path / "missing_seed0"), "--out", str(out)]) == 2
    assert f"run directory {tmp_path / 'missing_seed0'} does not exist" in capsys.readouterr().err
    (tmp_path / "empty_seed0" / "tensorboard").mkdir(parents=True)
    assert plot_runs.main([str(tmp_path / "empty_seed0"), "--out", str(out)]) == 2
    assert f"run directory {tmp_path / 'empty_seed0'} holds no scalars" in capsys.readouterr().err
    _log_run(tmp_path / "cispo_seed0", [0.1, 0.2], skip=("loss/entropy",))
    assert plot_runs.main([str(tmp_path / "cispo_seed0"), "--out", str(out)]) == 2
    assert f"run directory {tmp_path / 'cispo_seed0'} has no loss/entropy scalars" in capsys.readouterr().err
    assert plot_runs.main([str(tmp_path / "cispo_seed0"), "--out", str(out), "--levels", "30"]) == 2
    assert "--levels 30.0 is not an accuracy" in capsys.readouterr().err
    assert not out.exists()


def test_logged_runs_give_a_png_and_the_table(tmp_path, capsys):
    runs = {"cispo_seed0": [0.1, 0.3, 0.5], "cispo_seed1": [0.1, 0.2, 0.5], "dapo_seed0": [0.1, 0.2, 0.3]}
    for name, accuracy in runs.items():
        _log_run(tmp_path / name, accuracy)
    out, table = tmp_path / "plots" / "compare.png", tmp_path / "table.md"
    argv = [*(str(tmp_path / name) for name in runs), "--out", str(out), "--table", str(table), "--levels", "0.3", "0.5"]
    assert plot_runs.main(argv) == 0
    assert out.read_bytes()[:8] == PNG_SIGNATURE and out.stat().st_size > 10_000
    rows = table_rows(table.read_text().split("\n\n")[0])
    # cispo reaches 0.3 at steps 2 and 4 (mean 3), 0.5 at 4 and 4; dapo 0.3 at step 4.
    assert rows["cispo"]["steps to 0.3 (x cispo)"] == "3.0 [2-4] (x1.00)" and rows["cispo"]["runs"] == "2"
    assert rows["dapo"]["steps to 0.3 (x cispo)"] == f"4.0 [4-4] (x{4 / 3:.2f})"
    assert rows["dapo"]["steps to 0.5 (x cispo)"] == "not reached (0/1)"
    # Per-step fractions: 0.01 at odd steps, 0.01 + 0.01 * step at even ones (steps 1..4).
    assert rows["dapo"]["clipped high"] == f"{100 * (0.01 + 0.03 + 0.01 + 0.05) / 4:.2f}%"
    printed = capsys.readouterr().out
    assert table.read_text().split("\n\n")[0] in printed and plot_runs.COUNTING_RULES in table.read_text()
