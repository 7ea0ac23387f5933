"""The metrics pipeline: TensorBoard events written and read back exactly, nothing from non-logging
ranks, the logging-rank rule against Megatron-Core's own rank layout, and the metric helpers against
hand-computed and numpy references."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch

from megacispo.metrics.logger import (
    MetricsLogger,
    Timer,
    format_console_line,
    is_logging_rank,
    moe_load_balance,
    pearson_correlation,
    read_scalars,
)


def _float32(value: float) -> float:
    """TensorBoard stores scalars as float32."""
    return float(np.float32(value))


def test_logger_round_trips_exact_keys_and_values(tmp_path, capsys):
    generator = torch.Generator().manual_seed(0)
    steps = {
        1: {
            "loss/policy_loss": torch.rand((), generator=generator),
            "rollout/reward_mean": 0.25,
            "loss/clip_frac_high": torch.rand(1, generator=generator),
            "perf/tokens_per_s": 1234,
            "perf/time_rollout_s": 1.5,
        },
        2: {
            "loss/policy_loss": torch.rand((), generator=generator, dtype=torch.float64),
            "rollout/reward_mean": 0.75,
            "loss/clip_frac_high": torch.rand(1, generator=generator),
            "perf/tokens_per_s": 2345,
            "perf/time_rollout_s": 1.25,
        },
    }
    consumed = {1: 8, 2: 16}
    with MetricsLogger(tmp_path, enabled=True) as logger:
        for step, metrics in steps.items():
            logger.log(step, metrics, consumed_samples=consumed[step])

    scalars = read_scalars(tmp_path)
    keys = set(steps[1])
    assert set(scalars) == keys | {key + "_vs_samples" for key in keys}
    for key in keys:
        expected = [(step, _float32(float(steps[step][key]))) for step in steps]
        assert scalars[key] == expected, key
        assert scalars[key + "_vs_samples"] == [(consumed[step], value) for step, (_, value) in zip(steps, expected)]

    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("step 1 | loss ") and "reward 0.250" in lines[0] and "time rollout 1.50s" in lines[0]
    assert "tok/s 2345" in lines[1]


def test_non_logging_rank_writes_nothing(tmp_path, capsys):
    logger = MetricsLogger(tmp_path, enabled=False)
    logger.log(1, {"rollout/reward_mean": 0.5, "loss/policy_loss": torch.tensor(0.1)}, consumed_samples=8)
    logger.close()
    assert list(tmp_path.iterdir()) == []
    assert capsys.readouterr().out == ""
    # Keys are checked on every rank, so a bad key cannot pass silently where nothing is written.
    with pytest.raises(ValueError, match="namespaced"):
        logger.log(2, {"reward_mean": 0.5})


def test_logger_rejects_bad_metrics(tmp_path):
    with MetricsLogger(tmp_path, enabled=True, console=False) as logger:
        with pytest.raises(ValueError, match="'loss'"):
            logger.log(1, {"loss": 1.0})
        with pytest.raises(ValueError, match="shape \\(3,\\)"):
            logger.log(1, {"loss/policy_loss": torch.ones(3)})
    with pytest.raises(ValueError, match="does not exist"):
        read_scalars(tmp_path / "elsewhere")


def test_console_line_format():
    line = format_console_line(
        7,
        {
            "loss/policy_loss": 0.123456, "rollout/reward_mean": 0.5, "rollout/accuracy": 0.25,
            "loss/clip_frac_high": 0.01, "loss/clip_frac_low": 0.0, "perf/tokens_per_s": 1500.4,
            "perf/time_rollout_s": 1.234, "perf/time_update_s": 0.5, "train/grad_norm": 3.0,
        },
    )
    assert line == (
        "step 7 | loss 0.1235 | reward 0.500 | acc 0.250 | clip_hi 0.0100 | clip_lo 0.0000 | tok/s 1500"
        " | time rollout 1.23s update 0.50s"
    )


def logging_rank_for(world_size: int, pipeline_model_parallel_size: int = 1) -> int:
    """The global rank that logs: tensor-parallel rank 0, data-parallel rank 0 of the LAST pipeline
    stage, where the loss lives. Megatron-Core's default rank order ("tp-cp-ep-dp-pp") varies the
    pipeline stage slowest, so the last stage holds the last ``world_size // pp`` ranks and its first
    rank has TP = CP = DP = 0."""
    if pipeline_model_parallel_size < 1 or world_size % pipeline_model_parallel_size:
        raise ValueError(
            f"pipeline_model_parallel_size = {pipeline_model_parallel_size} does not divide world_size = "
            f"{world_size}: pass the run's PP size (a divisor of the world size)."
        )
    return (pipeline_model_parallel_size - 1) * (world_size // pipeline_model_parallel_size)


@pytest.mark.parametrize("tp, dp, pp, cp", [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 2, 1), (2, 2, 2, 1),
                                           (2, 1, 4, 1), (1, 3, 3, 1), (2, 2, 2, 2)])
def test_logging_rank_is_first_rank_of_last_stage(tp, dp, pp, cp):
    """Checked against Megatron-Core's own rank generator: the logging rank is in the last pipeline
    stage and has TP, CP and DP rank 0."""
    from megatron.core.parallel_state import RankGenerator

    generator = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    rank = logging_rank_for(tp * dp * pp * cp, pp)
    for token, position in (("pp", pp - 1), ("tp", 0), ("dp", 0), ("cp", 0)):
        (group,) = [group for group in generator.get_ranks(token) if rank in group]
        assert group.index(rank) == position, (token, group)
    with pytest.raises(ValueError, match="does not divide"):
        logging_rank_for(6, 4)


def test_is_logging_rank_without_distributed():
    assert not torch.distributed.is_initialized()
    assert is_logging_rank()


def test_pearson_known_values_and_numpy():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    # Centered: [-2,-1,0,1,2] and [-1,-2,1,0,2]: 8 / sqrt(10 * 10).
    assert pearson_correlation(x, torch.tensor([2.0, 1.0, 4.0, 3.0, 5.0])) == pytest.approx(0.8, abs=1e-15)
    assert pearson_correlation(x, 3 * x + 1) == pytest.approx(1.0, abs=1e-15)
    assert pearson_correlation(x, -x) == pytest.approx(-1.0, abs=1e-15)

    generator = torch.Generator().manual_seed(3)
    probs = torch.rand(1001, generator=generator)
    noisy = (probs + 0.05 * torch.randn(1001, generator=generator)).clamp(0, 1)
    expected = np.corrcoef(probs.double().numpy(), noisy.double().numpy())[0, 1]
    assert pearson_correlation(probs, noisy) == pytest.approx(expected, abs=1e-12)
    assert 0.9 < expected < 1.0


def test_pearson_undefined_and_bad_shapes():
    assert math.isnan(pearson_correlation(torch.full((5,), 0.9), torch.rand(5)))
    assert math.isnan(pearson_correlation(torch.rand(5), torch.zeros(5)))
    assert math.isnan(pearson_correlation(torch.tensor([0.5]), torch.tensor([0.4])))
    with pytest.raises(ValueError, match="same length"):
        pearson_correlation(torch.rand(4), torch.rand(5))
    with pytest.raises(ValueError, match="1-D"):
        pearson_correlation(torch.rand(2, 3), torch.rand(2, 3))


def test_moe_load_balance_known_table():
    tokens_per_expert = torch.tensor([[10, 10, 10, 10], [40, 0, 0, 0], [5, 15, 10, 10], [0, 0, 0, 0]])
    metrics = moe_load_balance(tokens_per_expert)
    assert metrics["moe/load_max_over_mean_layer0"] == 1.0
    assert metrics["moe/load_max_over_mean_layer1"] == 4.0
    assert metrics["moe/load_max_over_mean_layer2"] == 1.5
    assert math.isnan(metrics["moe/load_max_over_mean_layer3"])
    assert metrics["moe/load_max_over_mean"] == pytest.approx((1.0 + 4.0 + 1.5) / 3, abs=1e-15)
    assert metrics["moe/load_max_over_mean_max"] == 4.0
    assert len(metrics) == 6

    ragged = moe_load_balance([torch.tensor([3, 1]), torch.tensor([2, 2, 2, 6, 0, 0])])
    assert ragged["moe/load_max_over_mean_layer0"] == 1.5
    assert ragged["moe/load_max_over_mean_layer1"] == 3.0
    with pytest.raises(ValueError, match="negative"):
        moe_load_balance(torch.tensor([[1, -1]]))
    with pytest.raises(ValueError, match="empty"):
        moe_load_balance([])


def test_timer_accumulates_phases_and_resets():
    timer = Timer()
    with timer("rollout"):
        time.sleep(0.02)
    with timer("rollout"):
        time.sleep(0.02)
    with timer("update"):
        pass
    metrics = timer.metrics()
    assert set(metrics) == {"perf/time_rollout_s", "perf/time_update_s"}
    assert 0.04 <= metrics["perf/time_rollout_s"] < 5.0
    assert 0.0 <= metrics["perf/time_update_s"] < metrics["perf/time_rollout_s"]
    assert timer.metrics() == {}
    with pytest.raises(ValueError, match="phase"):
        with timer("Old LogP"):
            pass
