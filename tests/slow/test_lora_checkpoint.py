"""LoRA checkpoints (slow tier): a resumed LoRA run continues bit for bit as an uninterrupted one, over the
base that train.load names, and refuses another base; the adapter-only checkpoint of the `small` model is
under 5% of a full one."""

from __future__ import annotations

from pathlib import Path

import torch

from megacispo.testing.checkpoints import checkpoint_tensors
from megacispo.testing.harness import run_distributed, run_entry_point
from megacispo.testing.parallel_case import save_random_tiny_checkpoint
from megacispo.testing.rl_runs import run_overrides, run_train

LORA = ["--set", "lora.rank=4", "--set", "lora.alpha=8"]


def test_a_resumed_lora_run_continues_bit_for_bit(task_files, tmp_path):
    from megacispo.metrics.logger import read_scalars

    run_distributed(save_random_tiny_checkpoint, 1, str(tmp_path / "base"), 0, 0.02)
    base = ["--set", f"train.load={tmp_path / 'base' / 'step_00000000'}"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_distributed(run_train, 2, run_overrides(task_files, straight, steps=3) + LORA + base, timeout_s=600)
    run_distributed(run_train, 2, run_overrides(task_files, resumed, steps=2) + LORA + base, timeout_s=600)
    run_distributed(run_train, 2, run_overrides(task_files, resumed, steps=3) + LORA + base + ["--resume"],
                    timeout_s=600)
    losses = [dict(read_scalars(str(run))["loss/policy_loss"])[3] for run in (straight, resumed)]
    assert losses[0] == losses[1]
    expected = checkpoint_tensors(straight / "checkpoints" / "step_00000003")
    actual = checkpoint_tensors(resumed / "checkpoints" / "step_00000003")
    assert expected.keys() == actual.keys() and all(key.endswith(("lora_A", "lora_B")) for key in expected)
    assert all(torch.equal(actual[key], expected[key]) for key in expected)

    # The adapters over another base: refused, naming both.
    run_distributed(save_random_tiny_checkpoint, 1, str(tmp_path / "other"), 0, 0.03)
    other = tmp_path / "other" / "step_00000000"
    argv = run_overrides(task_files, resumed, steps=4) + LORA + ["--set", f"train.load={other}", "--resume"]
    results = run_distributed(run_entry_point, 2, "megacispo.train", argv, timeout_s=600)
    assert results[0]["code"] == 2
    assert "holds adapters trained on another base" in results[0]["out"], results[0]["out"][-2000:]
    assert f"set train.load={tmp_path / 'base' / 'step_00000000'}" in results[0]["out"]


def _save_small(root: str) -> None:
    """The `small` model's checkpoint with its optimizer state, full and with rank-8 adapters."""
    from megacispo.checkpoint.distributed import save_checkpoint
    from megacispo.config import to_dict
    from megacispo.parallel.layout import init_distributed
    from megacispo.startup import run_config
    from megacispo.training.engine import Engine

    for name, overrides in {"full": [], "lora": ["lora.rank=8", "train.load=unused"]}.items():
        config = run_config(None, ["model.size=small", "optimizer.use_distributed_optimizer=false", *overrides])
        if name == "full":
            init_distributed(config.parallel, seed=0)
        engine = Engine(config, total_steps=1, peak_lr=1e-4)
        save_checkpoint(f"{root}/{name}", 1, engine.module, engine.optimizer, engine.scheduler,
                        config_dict=to_dict(config))


def _bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def test_an_adapter_checkpoint_of_the_small_model_is_under_5_percent_of_a_full_one(tmp_path):
    run_distributed(_save_small, 1, str(tmp_path), timeout_s=600)
    full, lora = _bytes(tmp_path / "full" / "step_00000001"), _bytes(tmp_path / "lora" / "step_00000001")
    assert lora < 0.05 * full, (lora, full)
