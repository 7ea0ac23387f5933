"""Peak memory of checkpoint conversion (megacispo.checkpoint.to_megatron, to_hf) on the `small` model, both directions.

A randomly initialised `small`-size transformers MiniMaxForCausalLM (config from
hf_names.config_to_hf(model_config("small")), no download) is saved with save_pretrained; each
step then runs in a fresh subprocess that reports its own peak RSS (VmHWM):

- baseline: the imports (the converter's, and transformers for the set-up), nothing else;
- setup: the converter's fixed work before any tensor: a world of one and the model on the meta
  device (what hf-to-megatron builds to know the checkpoint's keys, shapes and chunks);
- hf-to-megatron and megatron-to-hf: the conversions (safetensors shards of at most
  --max-shard-bytes, default 5 GiB as the tool's, one shard here);
- whole-model load (peer): the checkpoint loaded into a single-process model with
  megacispo.checkpoint.distributed.load_checkpoint, which is what the previous converter did first.

The table gives peak RSS, peak - baseline, and that divided by the largest tensor's bytes (the
issue's bound: under 3x the largest tensor plus a fixed overhead, here the setup's).

    .venv/bin/python benchmarks/convert_memory.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import megatron.core  # noqa: F401  (the converter's first call imports it: part of every step's baseline)
import torch
from safetensors import safe_open
from transformers import MiniMaxConfig, MiniMaxForCausalLM

from megacispo.checkpoint.streaming import TensorMeter
from megacispo.checkpoint.to_hf import megatron_to_hf
from megacispo.checkpoint.to_megatron import checkpoint_contents, hf_to_megatron
from megacispo.models import model  # noqa: F401  (likewise)
from megacispo.models.config import PARAMS_DTYPES, model_config
from megacispo.models.hf_names import config_to_hf
from megacispo.testing.checkpoints import load_single_process
from megacispo.testing.memory import proc_status_mib

MIB = 1024**2


def _child(step: str, work: Path) -> dict:
    """One measured step, in this (fresh) process."""
    warnings.simplefilter("ignore")
    meter = TensorMeter()
    if step == "setup":
        checkpoint_contents(model_config("small"), PARAMS_DTYPES["float32"])
    elif step == "hf-to-megatron":
        hf_to_megatron(work / "hf", work / "ckpt", progress=False, meter=meter)
    elif step == "megatron-to-hf":
        megatron_to_hf(work / "ckpt", work / "hf_back", progress=False, meter=meter)
    elif step == "whole-model load":
        load_single_process(work / "ckpt")
    return {"peak_rss": int(proc_status_mib("VmHWM") * MIB), "meter_peak": meter.peak_bytes}


def _run_child(step: str, work: Path) -> dict:
    finished = subprocess.run([sys.executable, __file__, "--child", step, "--work", str(work)],
                              capture_output=True, text=True)
    if finished.returncode != 0:
        raise RuntimeError(f"{step} failed:\n{finished.stderr[-3000:]}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def _save_small_model(directory: Path) -> tuple[int, int]:
    """Save the random `small` model; returns (largest tensor bytes, total bytes) on disk."""
    torch.manual_seed(0)
    MiniMaxForCausalLM(MiniMaxConfig(**config_to_hf(model_config("small")))).save_pretrained(directory)
    sizes = []
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                tensor_slice = handle.get_slice(name)
                numel = 1
                for size in tensor_slice.get_shape():
                    numel *= size
                sizes.append(numel * {"F32": 4, "BF16": 2}[tensor_slice.get_dtype()])
    return max(sizes), sum(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, Path(args.work))))
        return
    with tempfile.TemporaryDirectory(prefix="convert_memory_") as scratch:
        work = Path(scratch)
        warnings.simplefilter("ignore")
        largest, total = _save_small_model(work / "hf")
        steps = ["baseline", "setup", "hf-to-megatron", "megatron-to-hf", "whole-model load"]
        results = {step: _run_child(step, work) for step in steps}
    baseline = results["baseline"]["peak_rss"]
    print(f"small model: {total / MIB:.1f} MiB of tensors (fp32), largest tensor {largest / MIB:.1f} MiB")
    print()
    print("| step | peak RSS (MiB) | baseline (MiB) | peak - baseline (MiB) | largest tensor (MiB) "
          "| (peak - baseline) / largest | TensorMeter peak (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for step in steps[1:]:
        peak, meter = results[step]["peak_rss"], results[step]["meter_peak"]
        meter_cell = f"{meter / MIB:.1f}" if meter else "-"
        print(f"| {step} | {peak / MIB:.1f} | {baseline / MIB:.1f} | {(peak - baseline) / MIB:.1f} | "
              f"{largest / MIB:.1f} | {(peak - baseline) / largest:.2f} | {meter_cell} |")

if __name__ == "__main__":
    main()
