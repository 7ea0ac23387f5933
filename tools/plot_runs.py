"""Compare RL runs: curves over steps into a PNG, and a table of the steps each group of runs needs
to reach given held-out accuracies; optionally, a sweep figure over the updates per rollout.

    python tools/plot_runs.py RUN_DIR [RUN_DIR ...] [--out compare.png] [--table table.md]
        [--levels 0.3 0.5] [--reference cispo] [--group-by-regex '^(.*)_seed\\d+$'] [--title TEXT]
        [--sweep sweep.png]

Runs are grouped (by default by the run directory's name without its ``_seed<N>`` suffix, so
``cispo_seed0`` and ``cispo_seed1`` form the group ``cispo``, and ``cispo_u16_seed2`` belongs to
``cispo_u16``); each panel draws a group's mean over its runs and the min-max band. The table
(markdown, printed and written to --table) gives per group the steps to reach each accuracy level
with their spread over seeds, the ratio to the reference group, the final accuracy, the mean
fractions of tokens the loss clipped or masked and, where the runs log the fork task's probe,
the fractions of marker tokens clipped; ``COUNTING_RULES`` says how they are counted.

Groups named ``<arm>_u<K>`` (K: updates per rollout) are one arm at one K. When the --reference
group does not exist, each such group's ratio divides by ``<reference>_u<K>``, the reference arm at
the same K. --sweep draws, per level, the steps to reach it against K (one line per arm), and the
final accuracy against K. Needs matplotlib (``pip install matplotlib``) for the PNGs only.
"""

from __future__ import annotations

import argparse
import io
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Sequence

from megacispo.files import atomic_write_bytes, atomic_write_text
from megacispo.metrics.logger import TENSORBOARD_DIR, read_scalars

Series = list[tuple[int, float]]
"""One scalar of one run: (step, value) in logged order."""

ACCURACY_TAG = "eval/accuracy"
CLIP_HIGH_TAG = "loss/clip_frac_high"
CLIP_LOW_TAG = "loss/clip_frac_low"
MASK_TAG = "loss/mask_frac"
# The fork task's probe (logging.metric_hooks.probe_token): the trainer logs the clip fractions of the marker
# tokens only at steps that sampled one, so these series may skip steps.
PROBE_START_TAG = "probe/start_prob"
PROBE_CLIP_HIGH_TAG = "probe/clip_frac_high"
PROBE_CLIP_LOW_TAG = "probe/clip_frac_low"
EPS_HIGH_TAG = "loss/eps_high_current"
# (tag, panel title); the table needs the first and the clip fractions, so every run must hold them.
# What "clipped" means differs by loss (PPO clip drops the token's gradient, CISPO caps its IS weight):
# docs/reports/cispo_vs_baselines.md explains.
REQUIRED_PANELS: tuple[tuple[str, str], ...] = (
    (ACCURACY_TAG, "held-out accuracy (greedy)"),
    ("rollout/reward_mean", "rollout reward (mean)"),
    ("loss/entropy", "policy entropy (nats/token)"),
    (CLIP_HIGH_TAG, "fraction of tokens clipped high"),
    (CLIP_LOW_TAG, "fraction of tokens clipped low"),
)
# Drawn where some run has the tag: the mask (all megacispo losses log it, 0 without one), the probe
# (runs with logging.metric_hooks.probe_token), the adapted bound (runs with rl.adaptive_clip) and the
# conversations' tool use (multi-turn runs with env.name: python).
OPTIONAL_PANELS: tuple[tuple[str, str], ...] = (
    (MASK_TAG, "fraction of tokens masked"),
    (PROBE_START_TAG, "marker probability at the response's start"),
    (PROBE_CLIP_HIGH_TAG, "fraction of marker tokens clipped high"),
    (PROBE_CLIP_LOW_TAG, "fraction of marker tokens clipped low"),
    (EPS_HIGH_TAG, "eps_high (adaptive clip bound)"),
    ("env/tool_calls", "tool calls per rollout sample"),
    ("env/correct_tool_use", "rollout samples with correct tool use"),
)
# The table's marker columns: (tag, header), shown when some run logs either tag.
MARKER_COLUMNS: tuple[tuple[str, str], ...] = (
    (PROBE_CLIP_HIGH_TAG, "marker clipped high"),
    (PROBE_CLIP_LOW_TAG, "marker clipped low"),
)
# The table's environment columns (multi-turn runs): (tag, header), each the first and the last RL
# step's value, shown when some run logs the tag.
ENV_COLUMNS: tuple[tuple[str, str], ...] = (
    ("env/turns", "model turns per sample"),
    ("env/tool_calls", "tool calls per sample"),
    ("env/correct_tool_use", "correct tool use"),
)
# With the marker columns: the RL steps until the marker's start probability (logged every step) first
# reaches this level, how fast each arm learns to take the branch.
MARKER_LEVEL = 0.5
DEFAULT_GROUP_REGEX = r"^(.*?)_seed\d+$"
# A group of the updates-per-rollout sweep: <arm>_u<K>.
SWEEP_GROUP_REGEX = re.compile(r"^(.+)_u(\d+)$")
DEFAULT_LEVELS = (0.3, 0.5)
COUNTING_RULES = (
    "Steps to reach a level: per run, the first evaluated RL step whose held-out accuracy is at least the "
    "level (step 0 is the SFT start; accuracy is evaluated every train.eval_every steps, so the count is "
    "a multiple of it); the cell is the mean over the group's runs, then [min-max] over its runs. "
    "'not reached (k/n: s1, s2)' means only k of its n runs reached the level within the run, at the "
    "steps listed, and no mean is given. The ratio divides a group's mean by the reference group's "
    "(lower is faster); where the reference group is absent, a group <arm>_u<K> divides by "
    "<reference>_u<K> (the same updates per rollout K); it is left out where either was not reached by "
    "every run. Start and final accuracy: the first (step 0, before RL) and the last evaluation of each "
    "run, mean +- sample standard deviation over runs. Environment columns (multi-turn runs): the "
    "rollout's mean per sample at the first RL step -> at the last, each the mean over runs. Clip and mask fractions: fraction of response tokens, averaged over every update of every "
    "step, then over runs. Marker clipped high/low (runs that log the probe): fraction of the probe's "
    "marker tokens clipped, averaged over the steps that sampled a marker, then over the runs that "
    "logged it ('-': none did). Steps to marker p: per run, the first RL step whose mean start "
    "probability of the marker over the rollout batch (logged every step) is at least the level; mean "
    "and [min-max] over runs as above."
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


def split_sweep_group(group: str) -> tuple[str, int] | None:
    """(arm, K) of a group named ``<arm>_u<K>`` (K: updates per rollout); None for any other name."""
    match = SWEEP_GROUP_REGEX.match(group)
    return None if match is None else (match.group(1), int(match.group(2)))


def group_runs(run_dirs: Sequence[Path], pattern: str = DEFAULT_GROUP_REGEX) -> dict[str, list[Path]]:
    """Runs by group name, groups in the order their first run was given."""
    groups: dict[str, list[Path]] = {}
    for run_dir in run_dirs:
        groups.setdefault(group_name(run_dir, pattern), []).append(run_dir)
    return groups


def load_run(run_dir: Path, required_tags: Sequence[str]) -> dict[str, Series]:
    """A run's scalars (megacispo.metrics.logger.read_scalars); ValueError naming the directory if it has
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


def marker_fraction(runs: Sequence[Mapping[str, Series]], tag: str) -> float | None:
    """``mean_fraction`` over the runs that logged ``tag`` (a probe series skips the steps that sampled
    no marker, so each run's mean is over the steps it has); None when no run did."""
    present = [run[tag] for run in runs if tag in run]
    return mean_fraction(present) if present else None


def reference_group(group: str, reference: str, groups: Collection[str]) -> str | None:
    """The group whose mean steps divide ``group``'s: ``reference`` when it is a group, else
    ``<reference>_u<K>`` for a group ``<arm>_u<K>`` (the same K) when that is one; None otherwise."""
    if reference in groups:
        return reference
    split = split_sweep_group(group)
    if split is None:
        return None
    same_updates = f"{reference}_u{split[1]}"
    return same_updates if same_updates in groups else None


def reference_label(reference: str, groups: Collection[str]) -> str:
    """The reference as the level headers name it: ``<reference>_u<K>`` when the ratios are per K."""
    if reference not in groups and any(reference_group(group, reference, groups) for group in groups):
        return f"{reference}_u<K>"
    return reference


def format_level_cell(result: LevelResult, ratio: float | None) -> str:
    """``mean [min-max] (xratio)``, or ``not reached (k/n: steps of the k)`` unless every run reached it."""
    reached = sorted(step for step in result.steps if step is not None)
    if result.mean_steps is None:
        listed = f": {', '.join(str(step) for step in reached)}" if reached else ""
        return f"not reached ({len(reached)}/{len(result.steps)}{listed})"
    cell = f"{result.mean_steps:.1f} [{reached[0]}-{reached[-1]}]"
    return cell + (f" (x{ratio:.2f})" if ratio is not None else "")


def format_first_to_last(series_per_run: Sequence[Series]) -> str:
    """'first -> last': the series' first and last values, each the mean over the runs that logged it."""
    logged = [series for series in series_per_run if series]
    if not logged:
        return "-"
    first = sum(series[0][1] for series in logged) / len(logged)
    last = sum(series[-1][1] for series in logged) / len(logged)
    return f"{first:.2f} -> {last:.2f}"


def format_percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.2f}%"


def comparison_table(
    runs_by_group: Mapping[str, Sequence[Mapping[str, Series]]],
    levels: Sequence[float],
    reference: str = "cispo",
) -> str:
    """The markdown table: one row per group, in the mapping's order.

    ``runs_by_group[group]`` holds one scalar dict per run (tag -> series) with at least
    eval/accuracy and the clip fractions; loss/mask_frac is shown where every run of a group has it;
    the marker columns are there when some run logs probe/clip_frac_*. ``reference``: see
    ``reference_group``.
    """
    groups = list(runs_by_group)
    level_headers = [f"steps to {level:g} (x {reference_label(reference, groups)})" for level in levels]
    all_runs = [run for runs in runs_by_group.values() for run in runs]
    markers = [(tag, name) for tag, name in MARKER_COLUMNS] if any(
        tag in run for run in all_runs for tag, _ in MARKER_COLUMNS) else []
    env_columns = [(tag, name) for tag, name in ENV_COLUMNS if any(tag in run for run in all_runs)]
    header = ["arm", "runs", *level_headers, "start accuracy", "final accuracy", *(name for _, name in env_columns),
              "clipped high", "clipped low", "masked",
              *(name for _, name in markers), *([f"steps to marker p {MARKER_LEVEL:g}"] if markers else [])]
    rows = [header, ["---"] * len(header)]
    results = {group: [level_result([run[ACCURACY_TAG] for run in runs], level) for level in levels]
               for group, runs in runs_by_group.items()}
    for group, runs in runs_by_group.items():
        reference_results = results.get(reference_group(group, reference, groups))
        cells = [format_level_cell(result, speed_ratio(result, reference_results[index] if reference_results else None))
                 for index, result in enumerate(results[group])]
        start_mean, start_std = mean_and_std([run[ACCURACY_TAG][0][1] for run in runs])
        final_mean, final_std = mean_and_std(final_values([run[ACCURACY_TAG] for run in runs]))
        masked = mean_fraction([run[MASK_TAG] for run in runs]) if all(MASK_TAG in run for run in runs) else None
        rows.append([
            group, str(len(runs)), *cells,
            f"{start_mean:.3f} +- {start_std:.3f}", f"{final_mean:.3f} +- {final_std:.3f}",
            *(format_first_to_last([run.get(tag, []) for run in runs]) for tag, _ in env_columns),
            format_percent(mean_fraction([run[CLIP_HIGH_TAG] for run in runs])),
            format_percent(mean_fraction([run[CLIP_LOW_TAG] for run in runs])),
            format_percent(masked),
            *(format_percent(marker_fraction(runs, tag)) for tag, _ in markers),
            *([format_level_cell(level_result([run.get(PROBE_START_TAG, []) for run in runs], MARKER_LEVEL), None)]
              if markers else []),
        ])
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


# ---------------------------------------------------------------------------------------------
# The plots: curves over steps, the sweep over K
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


@dataclass(frozen=True)
class SweepPoint:
    """One arm at one number of updates per rollout: a value per run of the group ``<arm>_u<K>``."""

    updates: int
    """K, the updates per rollout."""
    values: tuple[float | None, ...]
    """Per run; None where the run has none (it did not reach the level)."""

    @property
    def present(self) -> list[float]:
        return [value for value in self.values if value is not None]

    @property
    def complete(self) -> bool:
        return len(self.present) == len(self.values)


SweepValue = Callable[[Mapping[str, Series]], float | None]
"""A run's value for one sweep panel (its steps to a level, its final accuracy)."""


def sweep_points(runs_by_group: Mapping[str, Sequence[Mapping[str, Series]]],
                 value_of: SweepValue) -> dict[str, list[SweepPoint]]:
    """Per arm (in the order groups first name it), one point per K (ascending) from the groups named
    ``<arm>_u<K>``; other groups are left out."""
    by_arm: dict[str, list[SweepPoint]] = {}
    for group, runs in runs_by_group.items():
        split = split_sweep_group(group)
        if split is not None:
            arm, updates = split
            by_arm.setdefault(arm, []).append(SweepPoint(updates, tuple(value_of(run) for run in runs)))
    return {arm: sorted(points, key=lambda point: point.updates) for arm, points in by_arm.items()}


def steps_to_level(level: float) -> SweepValue:
    """A run's steps to reach ``level`` (None if it never did)."""
    return lambda run: steps_to_reach(run[ACCURACY_TAG], level)


def final_accuracy(run: Mapping[str, Series]) -> float:
    return final_values([run[ACCURACY_TAG]])[0]


def _pyplot() -> Any:
    """matplotlib.pyplot on the file-only back-end."""
    import matplotlib  # optional: the plot extra (pip install -e .[plot])

    matplotlib.use("Agg")  # no display: write files only
    import matplotlib.pyplot as plt

    return plt


def _save(figure: Any, out: Path) -> None:
    """The figure as a PNG at ``out``, written atomically, and closed."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=110)
    _pyplot().close(figure)
    atomic_write_bytes(out, buffer.getvalue())


def _panel_grid(num_panels: int, plt: Any) -> tuple[Any, Any]:
    """A figure of up to 3 panels a row; the cells past ``num_panels`` hidden."""
    num_columns = min(3, num_panels)
    num_rows = math.ceil(num_panels / num_columns)
    figure, axes = plt.subplots(num_rows, num_columns, figsize=(5 * num_columns, 3.6 * num_rows), squeeze=False)
    for axis in axes.flat[num_panels:]:
        axis.set_visible(False)
    return figure, axes


def plot_runs(runs_by_group: Mapping[str, Sequence[Mapping[str, Series]]], out: Path, title: str = "") -> None:
    """One panel per tag, each group's mean over its runs with the min-max band, into a PNG."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    all_runs = [run for runs in runs_by_group.values() for run in runs]
    panels = [*REQUIRED_PANELS, *((tag, name) for tag, name in OPTIONAL_PANELS if any(tag in run for run in all_runs))]
    figure, axes = _panel_grid(len(panels), plt)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (tag, name) in zip(axes.flat, panels):
        for index, (group, runs) in enumerate(runs_by_group.items()):
            present = [run[tag] for run in runs if tag in run]
            if not present:
                continue
            steps, mean, low, high = aggregate_over_runs(present)
            color = colors[index % len(colors)]
            # Evaluations and the probe's clip fractions skip steps: markers show the steps that have a value.
            marker = "o" if tag in (ACCURACY_TAG, PROBE_CLIP_HIGH_TAG, PROBE_CLIP_LOW_TAG) else None
            axis.plot(steps, mean, color=color, marker=marker, markersize=3, label=f"{group} (n={len(present)})")
            axis.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)
        axis.set_title(name, fontsize=10)
        axis.set_xlabel("RL step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.ticklabel_format(axis="y", useOffset=False)
        if tag == EPS_HIGH_TAG:
            # The controller moves the bound by a factor per update: equal factors, equal heights.
            axis.set_yscale("log")
        axis.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    figure.suptitle(title or "mean over runs, band: min to max")
    figure.tight_layout()
    _save(figure, out)


def plot_sweep(runs_by_group: Mapping[str, Sequence[Mapping[str, Series]]], levels: Sequence[float], out: Path,
               title: str = "") -> None:
    """Against K (the updates per rollout, log 2 axis), one panel per level with each arm's steps to
    reach it and one with its final accuracy: the mean over runs, bar from min to max. A K where only
    some runs reached the level has a hollow marker at their mean, labelled k/n; none: no marker."""
    plt = _pyplot()
    from matplotlib.ticker import NullLocator

    panels: list[tuple[str, SweepValue]] = [
        *((f"RL steps to reach accuracy {level:g}", steps_to_level(level)) for level in levels),
        ("final held-out accuracy", final_accuracy),
    ]
    updates = sorted({split[1] for split in map(split_sweep_group, runs_by_group) if split is not None})
    figure, axes = _panel_grid(len(panels), plt)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (name, value_of) in zip(axes.flat, panels):
        by_arm = sweep_points(runs_by_group, value_of)
        for index, (arm, points) in enumerate(by_arm.items()):
            _draw_sweep_arm(axis, [point for point in points if point.present], colors[index % len(colors)], arm,
                            # Arms side by side at each K, so their bars do not overlap.
                            dodge=2 ** (0.04 * (index - (len(by_arm) - 1) / 2)))
        axis.set_xscale("log", base=2)
        axis.set_xticks(updates, [str(k) for k in updates])
        axis.xaxis.set_minor_locator(NullLocator())
        axis.set_xlim(updates[0] / 1.5, updates[-1] * 1.5)
        axis.set_title(name, fontsize=10)
        axis.set_xlabel("updates per rollout (K)")
        axis.grid(alpha=0.3)
    # The final accuracy panel: the one where every arm has points.
    axes.flat[len(panels) - 1].legend(fontsize=8)
    figure.suptitle(title or "mean over runs, bar: min to max; hollow: only k of n runs reached the level")
    figure.tight_layout()
    _save(figure, out)


def _draw_sweep_arm(axis: Any, points: Sequence[SweepPoint], color: str, arm: str, dodge: float) -> None:
    """One arm's line through its points' means, each with its min-max bar and, where incomplete,
    a hollow marker and its k/n."""
    xs = [point.updates * dodge for point in points]
    means = [statistics.fmean(point.present) for point in points]
    axis.plot(xs, means, color=color, label=arm)
    for x, mean, point in zip(xs, means, points):
        bar = [[mean - min(point.present)], [max(point.present) - mean]]
        axis.errorbar([x], [mean], yerr=bar, fmt="o", color=color, capsize=3,
                      markerfacecolor=color if point.complete else "none")
        if not point.complete:
            axis.annotate(f"{len(point.present)}/{len(point.values)}", (x, mean), textcoords="offset points",
                          xytext=(5, 4), fontsize=7, color=color)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path, help="train.run_dir of each run")
    parser.add_argument("--out", type=Path, default=None, help="write the curves to this PNG")
    parser.add_argument("--table", type=Path, default=None, help="also write the markdown table here")
    parser.add_argument("--levels", type=float, nargs="+", default=list(DEFAULT_LEVELS),
                        help="held-out accuracy levels for the steps-to-reach columns, in [0, 1]")
    parser.add_argument("--reference", default="cispo",
                        help="the group the ratios divide by; when there is no such group, a group <arm>_u<K> "
                             "divides by <reference>_u<K> (the same updates per rollout K)")
    parser.add_argument("--group-by-regex", default=DEFAULT_GROUP_REGEX,
                        help="regex on the run directory name; its first capture group names the group")
    parser.add_argument("--title", default="", help="the figure's title")
    parser.add_argument("--sweep", type=Path, default=None,
                        help="also write this PNG: per level the steps to reach it, and the final accuracy, against "
                             "K for the groups named <arm>_u<K> (K: updates per rollout)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        bad_levels = [level for level in args.levels if not 0 <= level <= 1]
        if bad_levels:
            raise ValueError(f"--levels {bad_levels[0]} is not an accuracy: give levels in [0, 1], e.g. 0.3 0.5")
        if not (args.out or args.table or args.sweep):
            raise ValueError("nothing to write: give --out PNG, --table MD or --sweep PNG")
        groups = group_runs(args.run_dirs, args.group_by_regex)
        if args.sweep and not any(split_sweep_group(group) for group in groups):
            raise ValueError(
                f"--sweep {args.sweep}: no group is named <arm>_u<K> (groups: {', '.join(groups)}): name the runs "
                "<arm>_u<K>_seed<N> (K: updates per rollout), or leave --sweep out"
            )
        required = [tag for tag, _ in REQUIRED_PANELS]
        runs_by_group = {group: [load_run(run_dir, required) for run_dir in run_dirs]
                         for group, run_dirs in groups.items()}
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    table = comparison_table(runs_by_group, args.levels, args.reference)
    if args.out:
        plot_runs(runs_by_group, args.out, args.title)
    if args.sweep:
        plot_sweep(runs_by_group, args.levels, args.sweep, args.title)
    print(table)
    print()
    print(COUNTING_RULES)
    if args.table:
        atomic_write_text(args.table, f"{table}\n\n{COUNTING_RULES}\n")
        print(f"wrote {args.table}")
    for written in (args.out, args.sweep):
        if written:
            print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
