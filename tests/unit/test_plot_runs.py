"""tools/plot_runs.py for the updates-per-rollout sweep and the fork task's probe: the level cells with
their seed spread, the marker columns, the per-K reference ratio, the sweep's points and panels on
hand-made series, and main() on logged runs named <arm>_u<K>_seed<N> (the curves, the table, the
sweep PNG, and the error when --sweep has no such group). The table's other columns and the
script end to end: tests/test_compare_losses.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from megacispo.metrics.logger import MetricsLogger
from megacispo.testing.tool_modules import load_tool

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

plot_runs = load_tool("plot_runs")


def _run(accuracy, **extra):
    """A run's scalars as read_scalars returns them: accuracy, zero clip and mask fractions at steps
    1..4, and ``extra`` series (tag with '/' spelled '__')."""
    per_step = [(step, 0.0) for step in range(1, 5)]
    scalars = {"eval/accuracy": list(accuracy), "loss/clip_frac_high": per_step, "loss/clip_frac_low": per_step,
               "loss/mask_frac": per_step}
    scalars.update({tag.replace("__", "/"): series for tag, series in extra.items()})
    return scalars


def _table_rows(table: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The markdown table's header and rows as {arm: {column: cell}}."""
    lines = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()]
    header, _separator, *rows = lines
    return header, {row[0]: dict(zip(header, row)) for row in rows}


# ---------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------


def test_level_cells_give_the_seed_spread_and_the_steps_of_the_runs_that_reached():
    result = plot_runs.LevelResult(steps=(8, 4, 8))
    assert plot_runs.format_level_cell(result, 1.0) == "6.7 [4-8] (x1.00)"
    assert plot_runs.format_level_cell(result, None) == "6.7 [4-8]"
    assert plot_runs.format_level_cell(plot_runs.LevelResult(steps=(12,)), 1.5) == "12.0 [12-12] (x1.50)"
    # Not every run reached it: no mean and no ratio, the steps of those that did, in order.
    assert plot_runs.format_level_cell(plot_runs.LevelResult(steps=(12, None, 8)), 1.0) == "not reached (2/3: 8, 12)"
    assert plot_runs.format_level_cell(plot_runs.LevelResult(steps=(None, None)), None) == "not reached (0/2)"


def test_the_first_column_is_the_arm_and_the_marker_columns_need_a_run_that_logs_the_probe():
    plain = {"cispo": [_run([(0, 0.1), (4, 0.3)])], "dapo": [_run([(0, 0.1), (4, 0.3)])]}
    header, rows = _table_rows(plot_runs.comparison_table(plain, levels=[0.3]))
    assert header[0] == "arm" and list(rows) == ["cispo", "dapo"]
    assert not any("marker" in column for column in header)
    with_probe = {
        # The probe's series skip the steps that sampled no marker: the mean is over the logged ones.
        "cispo": [_run([(0, 0.1), (4, 0.3)], probe__clip_frac_high=[(1, 0.2), (3, 0.4)], probe__clip_frac_low=[(3, 0.1)],
                       probe__start_prob=[(1, 0.2), (2, 0.6), (3, 0.4)]),
                  _run([(0, 0.1), (4, 0.3)], probe__clip_frac_high=[(2, 0.1)], probe__start_prob=[(1, 0.5)]),
                  _run([(0, 0.1), (4, 0.3)])],  # no marker sampled at all: left out of the mean over runs
        "dapo": [_run([(0, 0.1), (4, 0.3)])],
    }
    header, rows = _table_rows(plot_runs.comparison_table(with_probe, levels=[0.3]))
    assert header[-3:] == ["marker clipped high", "marker clipped low", "steps to marker p 0.5"]
    # The start probability first reaches 0.5 at step 2 and step 1; the third run never logged it.
    assert rows["cispo"]["steps to marker p 0.5"] == "not reached (2/3: 1, 2)"
    assert rows["cispo"]["marker clipped high"] == f"{100 * (0.3 + 0.1) / 2:.2f}%"
    assert rows["cispo"]["marker clipped low"] == "10.00%"
    assert rows["dapo"]["marker clipped high"] == "-" and rows["dapo"]["marker clipped low"] == "-"
    assert rows["cispo"]["steps to 0.3 (x cispo)"] == "4.0 [4-4] (x1.00)"


def test_without_the_reference_group_each_k_divides_by_the_reference_arm_at_the_same_k():
    runs_by_group = {
        "cispo_u1": [_run([(0, 0.1), (4, 0.3)]), _run([(0, 0.1), (8, 0.3)])],  # mean 6
        "cispo_u4": [_run([(0, 0.1), (2, 0.3)])],  # mean 2
        "dapo_u1": [_run([(0, 0.1), (12, 0.3)])],
        "dapo_u4": [_run([(0, 0.1), (4, 0.3)]), _run([(0, 0.1), (8, 0.3)])],
        "dapo_u16": [_run([(0, 0.1), (4, 0.3)])],  # no cispo_u16: no ratio
        "baseline": [_run([(0, 0.1), (4, 0.3)])],  # not a sweep group: no ratio
    }
    groups = list(runs_by_group)
    assert plot_runs.reference_group("dapo_u4", "cispo", groups) == "cispo_u4"
    assert plot_runs.reference_group("dapo_u16", "cispo", groups) is None
    assert plot_runs.reference_group("baseline", "cispo", groups) is None
    assert plot_runs.reference_group("dapo_u4", "baseline", groups) == "baseline"  # a group that exists wins
    header, rows = _table_rows(plot_runs.comparison_table(runs_by_group, levels=[0.3], reference="cispo"))
    column = "steps to 0.3 (x cispo_u<K>)"
    assert column in header
    assert rows["cispo_u1"][column] == "6.0 [4-8] (x1.00)" and rows["cispo_u4"][column] == "2.0 [2-2] (x1.00)"
    assert rows["dapo_u1"][column] == "12.0 [12-12] (x2.00)"
    assert rows["dapo_u4"][column] == "6.0 [4-8] (x3.00)"
    assert rows["dapo_u16"][column] == "4.0 [4-4]" and rows["baseline"][column] == "4.0 [4-4]"
    # The named reference exists: every group divides by it, as before.
    header, rows = _table_rows(plot_runs.comparison_table(runs_by_group, levels=[0.3], reference="baseline"))
    assert rows["dapo_u4"]["steps to 0.3 (x baseline)"] == "6.0 [4-8] (x1.50)"


# ---------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------


def test_sweep_groups_split_into_arm_and_k_and_give_one_point_per_k_in_order():
    assert plot_runs.split_sweep_group("cispo_u16") == ("cispo", 16)
    assert plot_runs.split_sweep_group("clip_higher_u4") == ("clip_higher", 4)
    assert plot_runs.split_sweep_group("cispo") is None and plot_runs.split_sweep_group("cispo_ux") is None
    runs_by_group = {
        "cispo_u4": [_run([(0, 0.1), (4, 0.5)]), _run([(0, 0.1), (8, 0.4)])],
        "cispo_u1": [_run([(0, 0.1), (2, 0.5)])],
        "other": [_run([(0, 0.1), (2, 0.5)])],
    }
    points = plot_runs.sweep_points(runs_by_group, plot_runs.steps_to_level(0.5))
    assert list(points) == ["cispo"]
    assert [(point.updates, point.values, point.complete) for point in points["cispo"]] == [
        (1, (2,), True), (4, (4, None), False),
    ]
    finals = plot_runs.sweep_points(runs_by_group, plot_runs.final_accuracy)["cispo"]
    assert [point.values for point in finals] == [(0.5,), (0.5, 0.4)]


def test_sweep_panels_draw_hollow_markers_with_k_over_n_and_nothing_where_no_run_reached(monkeypatch, tmp_path):
    figures = []
    monkeypatch.setattr(plot_runs, "_save", lambda figure, out: figures.append(figure))
    runs_by_group = {
        "cispo_u1": [_run([(0, 0.1), (4, 0.5)]), _run([(0, 0.1), (8, 0.5)])],
        "cispo_u4": [_run([(0, 0.1), (4, 0.5)]), _run([(0, 0.1), (8, 0.4)])],  # 1 of 2 reaches 0.5
        "cispo_u16": [_run([(0, 0.1), (4, 0.4)])],  # none reaches 0.5
    }
    plot_runs.plot_sweep(runs_by_group, [0.5], tmp_path / "sweep.png")
    steps_axis, final_axis = figures[0].axes[:2]
    assert [label.get_text() for label in steps_axis.get_xticklabels()] == ["1", "4", "16"]
    assert steps_axis.get_xscale() == "log"
    assert [text.get_text() for text in steps_axis.texts] == ["1/2"]
    hollow = [line for line in steps_axis.get_lines() if line.get_marker() == "o" and line.get_markerfacecolor() == "none"]
    assert [(list(line.get_xdata()), list(line.get_ydata())) for line in hollow] == [([4.0], [4.0])]
    line = next(line for line in steps_axis.get_lines() if line.get_label() == "cispo")
    assert list(line.get_ydata()) == [6.0, 4.0]  # K = 16 has no point
    assert [text.get_text() for text in final_axis.texts] == []
    line = next(line for line in final_axis.get_lines() if line.get_label() == "cispo")
    assert list(line.get_ydata()) == pytest.approx([0.5, 0.45, 0.4])


# ---------------------------------------------------------------------------------------------
# main() on logged runs
# ---------------------------------------------------------------------------------------------


def _log_run(run_dir: Path, accuracy: list[float], probe: bool) -> None:
    """A run's events as the trainer writes them: eval/accuracy at steps 0, 2, 4..., the rest per step;
    with ``probe``, the marker's clip fractions at odd steps only (a marker sampled there)."""
    values = {"rollout/reward_mean": 0.2, "loss/entropy": 1.5, "loss/clip_frac_high": 0.01,
              "loss/clip_frac_low": 0.002, "loss/mask_frac": 0.0, "probe/start_prob": 0.3,
              "loss/eps_high_current": 0.2}
    with MetricsLogger(run_dir, enabled=True, console=False) as logger:
        for step in range(1, 2 * len(accuracy) - 1):
            marker = {"probe/clip_frac_high": 0.2, "probe/clip_frac_low": 0.05} if probe and step % 2 else {}
            logger.log(step, {**values, **marker})
        for index, value in enumerate(accuracy):
            logger.log(2 * index, {"eval/accuracy": value})


def test_main_on_a_sweep_writes_the_curves_the_sweep_and_the_table(tmp_path, capsys):
    runs = {"cispo_u1_seed0": ([0.1, 0.3, 0.5], False), "cispo_u4_seed0": ([0.1, 0.5, 0.6], False),
            "dapo_u1_seed0": ([0.1, 0.2, 0.3], True), "dapo_u4_seed0": ([0.1, 0.3, 0.4], True)}
    for name, (accuracy, probe) in runs.items():
        _log_run(tmp_path / name, accuracy, probe)
    out, sweep, table = tmp_path / "compare.png", tmp_path / "plots" / "sweep.png", tmp_path / "table.md"
    argv = [*(str(tmp_path / name) for name in runs), "--out", str(out), "--sweep", str(sweep),
            "--table", str(table), "--levels", "0.3", "0.5"]
    assert plot_runs.main(argv) == 0
    for png in (out, sweep):
        assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 10_000
    header, rows = _table_rows(table.read_text().split("\n\n")[0])
    assert list(rows) == ["cispo_u1", "cispo_u4", "dapo_u1", "dapo_u4"]
    assert header == ["arm", "runs", "steps to 0.3 (x cispo_u<K>)", "steps to 0.5 (x cispo_u<K>)", "start accuracy",
                      "final accuracy", "clipped high", "clipped low", "masked", "marker clipped high", "marker clipped low",
                      "steps to marker p 0.5"]
    level_03, level_05 = header[2:4]
    assert rows["dapo_u1"][level_03] == "4.0 [4-4] (x2.00)" and rows["dapo_u4"][level_03] == "2.0 [2-2] (x1.00)"
    assert rows["dapo_u1"][level_05] == "not reached (0/1)" and rows["cispo_u4"][level_05] == "2.0 [2-2] (x1.00)"
    assert rows["dapo_u4"]["marker clipped high"] == "20.00%" and rows["dapo_u4"]["marker clipped low"] == "5.00%"
    assert rows["cispo_u1"]["marker clipped high"] == "-"
    assert rows["cispo_u1"]["steps to marker p 0.5"] == "not reached (0/1)", "start probability 0.3 throughout"
    printed = capsys.readouterr().out
    assert f"wrote {sweep}" in printed and plot_runs.COUNTING_RULES in table.read_text()


def test_sweep_without_groups_named_by_k_is_an_error_before_anything_is_read(tmp_path, capsys):
    out, sweep = tmp_path / "compare.png", tmp_path / "sweep.png"
    argv = [str(tmp_path / "cispo_seed0"), str(tmp_path / "dapo_seed0"), "--out", str(out), "--sweep", str(sweep)]
    assert plot_runs.main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: --sweep {sweep}: no group is named <arm>_u<K> (groups: cispo, dapo)")
    assert not out.exists() and not sweep.exists()


def test_start_accuracy_and_the_environment_columns_of_multi_turn_runs():
    """Start accuracy is each run's step-0 evaluation (before RL); a multi-turn run's env/* series show
    first -> last RL step, each the mean over the runs that logged them; runs without them get none."""
    plain = {"cispo": [_run([(0, 0.1), (4, 0.3)]), _run([(0, 0.3), (4, 0.5)])]}
    header, rows = _table_rows(plot_runs.comparison_table(plain, levels=[0.3]))
    assert rows["cispo"]["start accuracy"] == "0.200 +- 0.141"
    assert not any("tool" in column for column in header)
    tools = {"rl": [_run([(0, 0.8), (10, 1.0)], env__tool_calls=[(1, 0.5), (10, 0.9)],
                         env__correct_tool_use=[(1, 0.4), (10, 0.8)]),
                    _run([(0, 0.6), (10, 1.0)], env__tool_calls=[(1, 0.7), (10, 1.0)],
                         env__correct_tool_use=[(1, 0.6), (10, 1.0)])]}
    header, rows = _table_rows(plot_runs.comparison_table(tools, levels=[0.9]))
    assert rows["rl"]["tool calls per sample"] == "0.60 -> 0.95"
    assert rows["rl"]["correct tool use"] == "0.50 -> 0.90"
    assert rows["rl"]["start accuracy"] == "0.700 +- 0.141" and "model turns per sample" not in header
