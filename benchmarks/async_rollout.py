"""The CPU quick start's RL, synchronous and colocated vs one step off-policy on a rollout process of its
own: samples per second and held-out accuracy after the same number of samples, a few seeds.

- colocated: today's path, 2 processes at EP = 2, each generating half of every round and then training
  on it (rollout.max_staleness = 0);
- colocated_ep1: the same at EP = 1 (2 whole-model data-parallel replicas): the colocated layout
  without the experts' all-to-all;
- placed: 1 training process + 1 rollout process (placement.rollout_ranks = 1, EP = 1), the rollout
  process generating round n + 1 with the weights of step n - 1 while step n trains
  (rollout.max_staleness = 1);
- placed_sync: the same processes, synchronous (rollout.max_staleness = 0): what the placement gives
  without the overlap.

Both start from the quick start's SFT checkpoint (examples/quickstart.sh makes it) and run --steps
steps of its config (64 prompts x 8 samples a step). Samples per second are measured between the
console lines of step 1 and step --steps, so start-up, the first evaluation and step 1 (which the
placed run cannot overlap) are left out; the held-out accuracy is the greedy accuracy on the quick
start's 200 test prompts after the last step. CPU seconds: all the run's processes, start-up
included. The machine's load average is printed with every run: other jobs on it slow both sides.

    .venv/bin/python benchmarks/async_rollout.py [--steps 8] [--seeds 0 1 2]
        [--modes colocated colocated_ep1 placed placed_sync]
        [--out runs/async_rollout]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from megacispo.metrics.logger import read_scalars

REPO = Path(__file__).resolve().parent.parent

CONFIG = "examples/configs/quickstart_cpu.yaml"
SFT_CHECKPOINTS = "runs/quickstart/sft/checkpoints"
MODES = {
    "colocated": ["parallel.expert_model_parallel_size=2"],
    "colocated_ep1": ["parallel.expert_model_parallel_size=1"],
    "placed": ["parallel.expert_model_parallel_size=1", "placement.rollout_ranks=1", "rollout.max_staleness=1"],
    "placed_sync": ["parallel.expert_model_parallel_size=1", "placement.rollout_ranks=1", "rollout.max_staleness=0"],
}


def run(mode: str, seed: int, steps: int, out: Path) -> dict[str, float]:
    """One torchrun of ``mode``; its samples/s (steps 2..N), accuracy after, CPU and wall seconds."""
    run_dir = out / f"{mode}_seed{seed}"
    overrides = MODES[mode] + [
        f"train.seed={seed}", f"train.steps={steps}", f"train.run_dir={run_dir}", "train.eval_every=0",
        "train.checkpoint_every=0", f"train.load={SFT_CHECKPOINTS}",
    ]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "megacispo.train", "--config", CONFIG, *[arg for o in overrides for arg in ("--set", o)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cpu_before = _children_cpu_s()
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    step_times: dict[int, float] = {}
    with subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as process:
        for line in process.stdout:
            step = re.match(r"step (\d+) \| ", line)  # the step's console line, not its progress bar
            if step:
                step_times[int(step.group(1))] = time.monotonic()
    if process.returncode:
        raise RuntimeError(f"{mode} seed {seed} failed with exit code {process.returncode} (see {run_dir})")
    samples = (steps - 1) * 64 * 8
    return {
        "samples_per_s": samples / (step_times[steps] - step_times[1]),
        "accuracy": read_scalars(str(run_dir))["eval/accuracy"][-1][1],
        "cpu_s": _children_cpu_s() - cpu_before,
        "wall_s": time.monotonic() - start,
        "load": (load_before + os.getloadavg()[0]) / 2,
    }


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "async_rollout")
    args = parser.parse_args()
    if not (REPO / SFT_CHECKPOINTS).is_dir():
        sys.exit(f"error: {SFT_CHECKPOINTS} is missing: run examples/quickstart.sh first (it makes the SFT warm start)")
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in args.modes}
    print("| mode | seed | samples/s | held-out accuracy | CPU s | wall s | load average |")
    print("|---|---|---|---|---|---|---|")
    for seed in args.seeds:
        for mode in args.modes:  # alternated, so that a change in the machine's load hits both alike
            result = run(mode, seed, args.steps, args.out)
            results[mode].append(result)
            print(f"| {mode} | {seed} | {result['samples_per_s']:.1f} | {result['accuracy']:.3f} | "
                  f"{result['cpu_s']:.0f} | {result['wall_s']:.0f} | {result['load']:.1f} |", flush=True)
    for mode, runs in results.items():
        rate = sum(r["samples_per_s"] for r in runs) / len(runs)
        accuracy = sum(r["accuracy"] for r in runs) / len(runs)
        print(f"{mode}: {rate:.1f} samples/s, accuracy {accuracy:.3f} (mean of {len(runs)} seeds)")
    if "colocated" in results:
        baseline = sum(r["samples_per_s"] for r in results["colocated"])
        for mode in (m for m in results if m != "colocated"):
            print(f"{mode} / colocated samples per second: "
                  f"{sum(r['samples_per_s'] for r in results[mode]) / baseline:.2f}x")


if __name__ == "__main__":
    main()
