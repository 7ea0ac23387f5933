"""Compare RL runs: curves over steps into a PNG, and a table of the steps each group of runs needs
to reach given held-out accuracies.

    python tools/plot_runs.py RUN_DIR [RUN_DIR ...] --out compare.png [--table table.md]
        [--levels 0.3 0.5] [--reference cispo] [--group-by-regex '^(.*)_seed\\d+$'] [--title TEXT]

Runs are grouped (by default by the run directory's name without its ``_seed<N>`` suffix, so
``cispo_seed0`` and ``cispo_seed1`` form the group ``cispo``); each panel draws a group's mean over
its runs and the min-max band. The table (markdown, printed and written to --table) gives per
group the steps to reach each accuracy level, the ratio to the reference group, the final accuracy
and the mean fractions of tokens the loss clipped or masked; ``COUNTING_RULES`` says how they are
counted. Needs matplotlib (``pip install matplotlib``) for the PNG only.
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from megacispo.metrics import TENSORBOARD_DIR, read_scalars

Series = list[tuple[int, float]]
"""One scalar of one run: (step, value) in logged order."""

ACCURACY_TAG = "eval/accuracy"
CLIP_HIGH_TAG = "loss/clip_frac_high"
CLIP_LOW_TAG = "loss/clip_frac_low"
MASK_TAG = "loss/mask_frac"
# (tag, panel title); the table needs the first and the clip fractions, so every run must hold them.
# What "clipped" means differs by loss (PPO clip drops the token's gradient, CISPO caps its IS weight):
# docs/cispo_vs_baselines.md explains.
REQUIRED_PANELS: tuple[tuple[str, str], ...] = (
    (ACCURACY_TAG, "held-out accuracy (greedy)"),
    ("rollout/reward_mean", "rollout reward (mean)"),
    ("loss/entropy", "policy entropy (nats/token)"),
    (CLIP_HIGH_TAG, "fraction of tokens clipped high"),
    (CLIP_LOW_TAG, "fraction of tokens clipped low"),
)
# Drawn where present: only losses with a token mask log it (all megacispo losses do, 0 without one).
OPTIONAL_PANELS: tuple[tuple[str, str], ...] = ((MASK_TAG, "fraction of tokens masked"),)
DEFAULT_GROUP_REGEX = r"^(.*?)_seed\d+$"
DEFAULT_LEVELS = (0.3, 0.5)
COUNTING_RULES = (
    "Steps to reach a level: per run, the first evaluated RL step whose held-out accuracy is at least the "
    "level (step 0 is the SFT start; accuracy is evaluated every train.eval_every steps, so the count is "
    "a multiple of it); the cell is the mean over the group's runs. 'not reached (k/n)' means only k of "
    "its n runs reached the level within the run, and no mean is given. The ratio divides a group's mean "
    "by the reference group's (lower is faster); it is left out where either was not reached by every "
    "run. Final accuracy: the last evaluation of each run, mean +- sample standard deviation over runs. "
    "Clip and mask fractions: fraction of response tokens, averaged over every update of every step, "
    "then over runs."
)


# ---------------------------------------------------------------------------------------------
# Reading and grouping runs
# ---------------------------------------------------------------------------------------------


def group_name(run_dir: Path, pattern: str = DEFAULT_GROUP_REGEX) -> str:
    """The group of a run: the regex's first capture group on the directory's name; the whole name
    when the default pattern does not match (a run without a seed suffix is its own group)."""
    match = re.search(pattern, run_dir.name)
    if match is None:
        if pattern == DEFAULT_GROUP_REGEX:
            return run_dir.name
        raise ValueError(
            f"--group-by-regex {pattern!r} does not match the run directory name {run_dir.name!r} ({run_dir}): "
            "give a regex that matches every run's directory name, with one capture group for the group"
        )
    if not match.groups():
        raise ValueError(f"--group-by-regex {pattern!r} has no capture group: wrap the group part in (...)")
    return match.group(1)


def group_runs(run_dirs: Sequence[Path], pattern: str = DEFAULT_GROUP_REGEX) -> dict[str, list[Path]]:
    """Runs by group name, groups in the order their first run was given."""
    groups: dict[str, list[Path]] = {}
    for run_dir in run_dirs:
        groups.setdefault(group_name(run_dir, pattern), []).append(run_dir)
    return groups


def load_run(run_dir: Path, required_tags: Sequence[str]) -> dict[str, Series]:
    """A run's scalars (megacispo.metrics.read_scalars); ValueError naming the directory if it has
    no TensorBoard events or lacks one of ``required_tags``."""
    if not run_dir.is_dir():
        raise ValueError(f"run directory {run_dir} does not exist: pass the train.run_dir of a finished run")
    scalars = read_scalars(run_dir)
    if not scalars:
        raise ValueError(
            f"run directory {run_dir} holds no scalars in {run_dir / TENSORBOARD_DIR}: pass the train.run_dir of a "
            "run that has logged at least one step"
        )
    missing = [tag for tag in required_tags if tag not in scalars]
    if missing:
        raise ValueError(
            f"run directory {run_dir} has no {', '.join(missing)} scalars: compare megacispo RL runs "
            "(megacispo.train; eval/accuracy needs data.test_prompts set)"
        )
    return scalars


# ---------------------------------------------------------------------------------------------
# The table: pure functions of scalar series
# ---------------------------------------------------------------------------------------------


def steps_to_reach(accuracy: Series, level: float) -> int | None:
    """The first step (in step order) whose value is at least ``level``; None if none is."""
    for step, value in sorted(accuracy):
        if value >= level:
            return step
    return None


@dataclass(frozen=True)
class LevelResult:
    """How one group of runs reached one accuracy level."""

    steps: tuple[int | None, ...]
    """Per run: the first step at or above the level, None if never."""

    @property
    def num_reached(self) -> int:
        return sum(step is not None for step in self.steps)

    @property
    def mean_steps(self) -> float | None:
        """Mean over runs; None unless every run reached the level."""
        if not self.steps or self.num_reached < len(self.steps):
            return None
        return statistics.fmean(self.steps)


def level_result(accuracies: Sequence[Series], level: float) -> LevelResult:
    return LevelResult(steps=tuple(steps_to_reach(accuracy, level) for accuracy in accuracies))


def speed_ratio(result: LevelResult, reference: LevelResult | None) -> float | None:
    """Mean steps over the reference's mean steps; None if either is undefined or the reference is 0."""
    if reference is None or result.mean_steps is None or not reference.mean_steps:
        return None
    return result.mean_steps / reference.mean_steps


def final_values(series_per_run: Sequence[Series]) -> list[float]:
    """Each run's value at its last step (a step logged twice counts with its last value)."""
    finals = []
    for series in series_per_run:
        by_step = dict(series)
        finals.append(by_step[max(by_step)])
    return finals


def mean_and_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def mean_fraction(series_per_run: Sequence[Series]) -> float:
    """Mean over runs of each run's mean over its steps."""
    return statistics.fmean(statistics.fmean(value for _, value in series) for series in series_per_run)


def format_level_cell(result: LevelResult, ratio: float | None) -> str:
    if result.mean_steps is None:
        return f"not reached ({result.num_reached}/{len(result.steps)})"
    cell = f"{result.mean_steps:.1f}"
    return cell + (f" (x{ratio:.2f})" if ratio is not None else "")


def format_percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.2f}%"


def comparison_table(
    runs_by_group: Mapping[str, Sequence[Mapping[str, Series]]],
    levels: Sequence[float],
    reference: str = "cispo",
) -> str:
    """The markdown table: one row per group, in the mapping's order.

    ``runs_by_group[group]`` holds one scalar dict per run (tag -> series) with at least
    eval/accuracy and the clip fractions; loss/mask_frac is shown where every run of a group has it.
    """
    level_headers = [f"steps to {level:g} (x {reference})" for level in levels]
    header = ["loss", "runs", *level_headers, "final accuracy", "clipped high", "clipped low", "masked"]
    rows = [header, ["---"] * len(header)]
    reference_results = None
    if reference in runs_by_group:
        reference_accuracies = [run[ACCURACY_TAG] for run in runs_by_group[reference]]
        reference_results = [level_result(reference_accuracies, level) for level in levels]
    for group, runs in runs_by_group.items():
        accuracies = [run[ACCURACY_TAG] for run in runs]
        cells = []
        for index, level in enumerate(levels):
            result = level_result(accuracies, level)
            ratio = speed_ratio(result, reference_results[index] if reference_results else None)
            cells.append(format_level_cell(result, ratio))
        final_mean, final_std = mean_and_std(final_values(accuracies))
        masked = mean_fraction([run[MASK_TAG] for run in runs]) if all(MASK_TAG in run for run in runs) else None
        rows.append([
            group, str(len(runs)), *cells, f"{final_mean:.3f} +- {final_std:.3f}",
            format_percent(mean_fraction([run[CLIP_HIGH_TAG] for run in runs])),
            format_percent(mean_fraction([run[CLIP_LOW_TAG] for run in runs])),
            format_percent(masked),
        ])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


# ---------------------------------------------------------------------------------------------
# The plot
# ---------------------------------------------------------------------------------------------


def aggregate_over_runs(series_per_run: Sequence[Series]) -> tuple[list[int], list[float], list[float], list[float]]:
    """(steps, mean, min, max) over the runs that logged each step; a step logged twice in one run
    (a resumed run) counts with its last value."""
    by_step: dict[int, list[float]] = {}
    for series in series_per_run:
        for step, value in dict(series).items():
            by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    return (steps, [statistics.fmean(by_step[s]) for s in steps], [min(by_step[s]) for s in steps],
            [max(by_step[s]) for s in steps])


def plot_runs(runs_by_group: Mapping[str, Sequence[Mapping[str, Series]]], out: Path, title: str = "") -> None:
    """One panel per tag, each group's mean over its runs with the min-max band, into a PNG."""
    import matplotlib  # optional: the plot extra (pip install -e .[plot])

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    all_runs = [run for runs in runs_by_group.values() for run in runs]
    panels = [*REQUIRED_PANELS, *((tag, name) for tag, name in OPTIONAL_PANELS if any(tag in run for run in all_runs))]
    num_columns = 3
    num_rows = math.ceil(len(panels) / num_columns)
    figure, axes = plt.subplots(num_rows, num_columns, figsize=(5 * num_columns, 3.6 * num_rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (tag, name) in zip(axes.flat, panels):
        for index, (group, runs) in enumerate(runs_by_group.items()):
            present = [run[tag] for run in runs if tag in run]
            if not present:
                continue
            steps, mean, low, high = aggregate_over_runs(present)
            color = colors[index % len(colors)]
            marker = "o" if tag == ACCURACY_TAG else None
            axis.plot(steps, mean, color=color, marker=marker, markersize=3, label=f"{group} (n={len(present)})")
            axis.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)
        axis.set_title(name, fontsize=10)
        axis.set_xlabel("RL step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.ticklabel_format(axis="y", useOffset=False)
        axis.grid(alpha=0.3)
    for axis in axes.flat[len(panels):]:
        axis.set_visible(False)
    axes.flat[0].legend(fontsize=8)
    figure.suptitle(title or "mean over runs, band: min to max")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path, help="train.run_dir of each run")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--table", type=Path, default=None, help="also write the markdown table here")
    parser.add_argument("--levels", type=float, nargs="+", default=list(DEFAULT_LEVELS),
                        help="held-out accuracy levels for the steps-to-reach columns, in [0, 1]")
    parser.add_argument("--reference", default="cispo", help="the group the ratios divide by")
    parser.add_argument("--group-by-regex", default=DEFAULT_GROUP_REGEX,
                        help="regex on the run directory name; its first capture group names the group")
    parser.add_argument("--title", default="", help="the figure's title")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        bad_levels = [level for level in args.levels if not 0 <= level <= 1]
        if bad_levels:
            raise ValueError(f"--levels {bad_levels[0]} is not an accuracy: give levels in [0, 1], e.g. 0.3 0.5")
        required = [tag for tag, _ in REQUIRED_PANELS]
        runs_by_group = {group: [load_run(run_dir, required) for run_dir in run_dirs]
                         for group, run_dirs in group_runs(args.run_dirs, args.group_by_regex).items()}
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    table = comparison_table(runs_by_group, args.levels, args.reference)
    plot_runs(runs_by_group, args.out, args.title)
    print(table)
    print()
    print(COUNTING_RULES)
    if args.table:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(f"{table}\n\n{COUNTING_RULES}\n")
        print(f"wrote {args.table}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
