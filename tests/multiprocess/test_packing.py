"""Packed micro-batches (train.pack_sequences) compute what right-padded rows compute.

The trainer's own passes on the tiny model (lightning and softmax layers, MoE), on one batch of
long-tailed sequences: the old log-probs, and one update's loss, metrics and gradients, packed by
token budgets that give 1, 2 and 5 micro-batches, against the padded layout in one micro-batch;
cispo (token mean) and gspo (per-sequence ratio, sequence mean), with routing replay of recorded
experts. At DP = 2 the ranks hold sequences of different lengths and totals, agree on their number
of micro-batches, and their update's gradients equal the one-process padded run over both halves.

The MoE auxiliary loss is off (model.moe_aux_loss_coeff = 0): it is a statistic of each micro-batch's
tokens, so it changes with the micro-batching in either layout (as in Megatron-LM).
"""

from __future__ import annotations

import pytest
import torch

from megacispo.testing.harness import run_distributed
from megacispo.testing.parallel_case import assert_close_by_key

# Prompt and response lengths of the 16 sequences; ranks of DP = 2 take 8 each.
PROMPTS = (5, 3, 12, 4, 7, 2, 9, 6, 3, 8, 4, 11, 5, 2, 6, 3)
RESPONSES = (40, 3, 1, 25, 2, 6, 1, 60, 9, 2, 30, 4, 1, 7, 3, 2)
VOCAB, EXPERTS, TOPK = 512, 4, 2


def _sequences(rows: range) -> dict[str, torch.Tensor]:
    """The batch of ``rows``, right-padded as the trainer batches a step (seed 5 for all rows)."""
    generator = torch.Generator().manual_seed(5)
    total = len(PROMPTS)
    lengths = torch.tensor(PROMPTS) + torch.tensor(RESPONSES)
    width = int(lengths[list(rows)].max())
    tokens = torch.randint(3, VOCAB, (total, int(lengths.max())), generator=generator)
    routes = torch.randint(0, EXPERTS, (total, int(lengths.max()), 8, TOPK), generator=generator)
    routes = torch.where(routes[..., :1] == routes[..., 1:], (routes + 1) % EXPERTS, routes)  # distinct top-k
    advantages = torch.randn(total, generator=generator, dtype=torch.float64).float()
    rollout_logprobs = -torch.rand(total, int(lengths.max()) - 1, generator=generator)
    positions = torch.arange(int(lengths.max()))
    real = positions < lengths[:, None]
    response = (positions >= torch.tensor(PROMPTS)[:, None]) & real
    index = list(rows)
    return {
        "tokens": torch.where(real, tokens, 0)[index, :width],
        "loss_mask": response[index, 1:width].float(),
        "advantages": advantages[index],
        "rollout_logprobs": torch.where(response[:, 1:], rollout_logprobs, 0.0)[index, :width - 1],
        "padding_mask": ~real[index, :width],
        "routes": torch.where(real[..., None, None], routes, 0)[index, :width].to(torch.uint8),
    }


def _pass(pack: bool, budget: int, loss: str, layout: dict | None = None, balance: bool = False,
          size: str = "tiny", **model_fields) -> dict:
    """Old log-probs and one update of this rank's batch (its data-parallel share of the 16 sequences) in
    ``layout`` (ParallelConfig's fields; None: the world is data-parallel), its rows first moved between
    the data-parallel ranks with ``balance`` (``Trainer._balance_over_dp``), on the model of ``size`` (8
    layers of 4 experts: tiny or tiny-m2) with ``model_fields``: the old log-probs [n, S - 1] and the rows
    they are of, the update's metrics, the gradients by name, the number of micro-batches, the tokens the
    rank trained, the routers' selection biases after the update (M2)."""
    import torch.distributed as dist

    from megacispo.config import Config
    from megacispo.models.config import model_config
    from megacispo.parallel.layout import ParallelConfig
    from megacispo.rl.config import LossConfig, RLConfig
    from megacispo.rl.trainer import TrainBatch
    from megacispo.testing.trainers import build_trainer
    from megacispo.training.config import OptimizerConfig, TrainConfig

    config = Config(
        model=model_config(size, moe_aux_loss_coeff=0.0, **model_fields),
        rl=RLConfig(updates_per_rollout=1, routing_replay=True, loss=LossConfig(name=loss)),
        train=TrainConfig(pack_sequences=pack, max_tokens_per_micro_batch=budget, micro_batch_size=16,
                          run_dir="runs/unused"),
        optimizer=OptimizerConfig(use_distributed_optimizer=False, clip_grad=0.0),
        parallel=ParallelConfig(**(layout or {})),
    )
    trainer = build_trainer(config)
    rank, size = dist.get_rank(trainer.dp_group), dist.get_world_size(trainer.dp_group)
    rows = range(rank * len(PROMPTS) // size, (rank + 1) * len(PROMPTS) // size)
    batch = TrainBatch(**_sequences(rows))
    tokens_before = int((~batch.padding_mask).sum())
    if balance:
        batch, _ = trainer._balance_over_dp(batch)
    micro_batches = len(trainer._micro_batches(batch))
    batch.old_logprobs = trainer.compute_old_logprobs(batch)
    grads = _keep_gradients(trainer.engine)
    metrics = trainer._update_once(batch)
    biases = {name: buffer.clone() for name, buffer in trainer.engine.module.named_buffers() if "expert_bias" in name}
    return {"old_logprobs": batch.old_logprobs, "metrics": metrics, "grads": grads, "micro_batches": micro_batches,
            "tokens": batch.tokens, "tokens_before": tokens_before, "tokens_trained": int((~batch.padding_mask).sum()),
            "expert_biases": biases}


def _keep_gradients(engine) -> dict[str, torch.Tensor]:
    """The dict that the engine's next optimizer step fills, before it applies them, with the gradients
    of the parameters that train (by name; all-reduced: use_distributed_optimizer is off)."""
    grads: dict[str, torch.Tensor] = {}
    step = engine.step

    def step_keeping_grads():
        grads.update({name: param.main_grad.detach().clone() for name, param in engine.module.named_parameters()
                      if param.requires_grad})
        return step()

    engine.step = step_keeping_grads
    return grads


def _budget_for(micro_batches: int) -> int:
    """The smallest budget (at least the longest sequence) that packs all 16 sequences into
    ``micro_batches`` micro-batches."""
    from megacispo.training.packing import bins_needed

    lengths = [p + r for p, r in zip(PROMPTS, RESPONSES)]
    budget = next(b for b in range(max(lengths), sum(lengths) + 1) if bins_needed(lengths, b) == micro_batches)
    return budget


def _assert_same(expected: dict, actual: dict, what: str) -> None:
    torch.testing.assert_close(actual["old_logprobs"], expected["old_logprobs"], rtol=1e-5, atol=1e-5,
                               msg=f"{what}: old log-probs")
    for key in ("loss/policy_loss", "loss/entropy", "loss/num_tokens", "loss/clip_frac_high", "perf/grad_norm"):
        assert actual["metrics"][key] == pytest.approx(expected["metrics"][key], rel=1e-5, abs=1e-7), (what, key)
    assert_close_by_key(expected["grads"], actual["grads"], f"{what}: gradient of", rtol=1e-4)


@pytest.fixture(scope="module")
def padded() -> dict:
    """Both losses on all 16 sequences right-padded in one micro-batch, in one process."""
    return {loss: run_distributed(_pass, 1, False, 0, loss)[0] for loss in ("cispo", "gspo")}


@pytest.mark.parametrize("loss", ["cispo", "gspo"])
@pytest.mark.parametrize("micro_batches", [1, 2, 5])
def test_packed_micro_batches_compute_what_padded_rows_compute(padded, loss, micro_batches):
    (packed,) = run_distributed(_pass, 1, True, _budget_for(micro_batches), loss)
    assert packed["micro_batches"] == micro_batches
    _assert_same(padded[loss], packed, f"{loss}, {micro_batches} packed micro-batches")


def test_ranks_with_unequal_sequences_agree_and_match_one_process(padded):
    """DP = 2: rank 0's 8 sequences hold 186 tokens, rank 1's 100; a budget of 100 fits rank 1's in
    one micro-batch and rank 0's in two, so both run two."""
    from megacispo.data.padding import pad_right

    results = run_distributed(_pass, 2, True, 100, "cispo")
    assert [r["micro_batches"] for r in results] == [2, 2]
    whole = padded["cispo"]
    width = whole["old_logprobs"].shape[1]
    both = torch.cat([pad_right(r["old_logprobs"], width) for r in results])
    for result in results:
        _assert_same(whole, {**result, "old_logprobs": both}, "DP = 2 packed")


def test_balanced_ranks_train_equal_tokens_and_match_one_process(padded):
    """DP = 2 with rank 0 holding 186 tokens and rank 1 100: after the exchange the ranks hold 8 sequences
    and 146 and 140 tokens (the LPT split of these lengths), every sequence once, and they train to the
    one-process run's loss and gradients."""
    from megacispo.data.padding import pad_right

    results = run_distributed(_pass, 2, True, 100, "cispo", None, True)
    assert [r["tokens_before"] for r in results] == [186, 100]
    assert [r["tokens_trained"] for r in results] == [146, 140]
    whole, one = padded["cispo"], _sequences(range(len(PROMPTS)))
    width = whole["old_logprobs"].shape[1]
    # Each rank's rows are sequences of the whole batch: find them by their tokens.
    tokens = torch.cat([pad_right(r["tokens"], width + 1) for r in results])
    rows = [next(i for i in range(len(PROMPTS)) if torch.equal(one["tokens"][i], row)) for row in tokens]
    assert sorted(rows) == list(range(len(PROMPTS))) and rows != list(range(len(PROMPTS)))
    moved = torch.cat([pad_right(r["old_logprobs"], width) for r in results])
    restored = torch.empty_like(moved)
    restored[rows] = moved
    for result in results:
        _assert_same(whole, {**result, "old_logprobs": restored}, "DP = 2 balanced")


def _sft_step(pack: bool, budget: int, layout: dict | None = None) -> dict:
    """One SFT step on 8 pairs of long-tailed lengths: its loss, gradients and micro-batches."""
    from megacispo.config import Config
    from megacispo.data.prompts import PromptRecord
    from megacispo.metrics.logger import MetricsLogger
    from megacispo.models.config import model_config
    from megacispo.parallel.layout import ParallelConfig, init_distributed
    from megacispo.testing.trainers import CharTokenizer
    from megacispo.training.config import OptimizerConfig, SFTConfig, TrainConfig
    from megacispo.training.engine import Engine
    from megacispo.training.sft import SFTTrainer

    config = Config(
        model=model_config("tiny", moe_aux_loss_coeff=0.0), sft=SFTConfig(batch_size=8),
        train=TrainConfig(pack_sequences=pack, max_tokens_per_micro_batch=budget, micro_batch_size=8,
                          run_dir="runs/unused"),
        optimizer=OptimizerConfig(use_distributed_optimizer=False, clip_grad=0.0),
        parallel=ParallelConfig(**(layout or {})),
    )
    init_distributed(config.parallel, config.train.seed)
    engine = Engine(config, total_steps=1, peak_lr=1e-3)
    pairs = [PromptRecord(prompt="q" * prompt, answer="a" * answer)
             for prompt, answer in zip(PROMPTS[:8], RESPONSES[:8])]
    trainer = SFTTrainer(config, engine, CharTokenizer(), pairs, MetricsLogger("runs/unused", enabled=False))
    micro_batches = len(trainer._micro_batches())
    grads = _keep_gradients(engine)
    metrics = trainer.train_step()
    return {"loss": metrics["sft/loss"], "grads": grads, "micro_batches": micro_batches}


def test_sft_packed_step_computes_what_padded_rows_compute():
    """Packed in 3 micro-batches in one process, and split over 2 CP ranks."""
    (padded,) = run_distributed(_sft_step, 1, False, 0)
    (packed,) = run_distributed(_sft_step, 1, True, 70)
    split = run_distributed(_sft_step, 2, True, 70, {"context_parallel_size": 2})
    assert (padded["micro_batches"], packed["micro_batches"]) == (1, 3)
    for result in (packed, *split):
        assert result["loss"] == pytest.approx(padded["loss"], rel=1e-5)
        assert_close_by_key(padded["grads"], result["grads"], "SFT packed: gradient of", rtol=1e-4)


@pytest.mark.parametrize("layout", [{"context_parallel_size": 2}, {"context_parallel_size": 4}],
                         ids=["cp2", "cp4"])
def test_context_parallel_ranks_compute_what_one_process_computes(padded, layout):
    """Every row of 5 packed micro-batches split over 2 and 4 CP ranks (zigzag): each rank's old
    log-probs are the whole batch's, and its update's loss, metrics and gradients the one-process run's."""
    results = run_distributed(_pass, layout["context_parallel_size"], True, _budget_for(5), "cispo", layout)
    for result in results:
        assert result["micro_batches"] == 5
        _assert_same(padded["cispo"], result, f"CP = {layout['context_parallel_size']}")


def _rl_step(layout: dict | None) -> dict:
    """One rollout round (the 4 prompts x 2 samples) and update in ``layout``, advantages fixed: the batch's
    tokens, old log-probs, the update's metrics and gradients."""
    from megacispo.config import Config
    from megacispo.models.config import model_config
    from megacispo.parallel.layout import ParallelConfig
    from megacispo.rl.config import RLConfig
    from megacispo.rollout.config import RolloutConfig
    from megacispo.testing.trainers import build_trainer
    from megacispo.training.config import OptimizerConfig, TrainConfig

    config = Config(
        model=model_config("tiny", moe_aux_loss_coeff=0.0),
        rollout=RolloutConfig(prompts_per_step=4, group_size=2, max_new_tokens=6, dynamic_sampling=False),
        rl=RLConfig(updates_per_rollout=1, routing_replay=True),
        train=TrainConfig(micro_batch_size=2, run_dir="runs/unused"),
        optimizer=OptimizerConfig(use_distributed_optimizer=False, clip_grad=0.0),
        parallel=ParallelConfig(**(layout or {})),
    )
    trainer = build_trainer(config)
    batch, _ = trainer.collect_rollouts()
    # Of mixed signs but no zero sum, which would leave the loss a small difference of large terms.
    batch.advantages = torch.linspace(-0.5, 1.0, len(batch), device=batch.tokens.device)
    batch.old_logprobs = trainer.compute_old_logprobs(batch)
    grads = _keep_gradients(trainer.engine)
    metrics = trainer._update_once(batch)
    return {"tokens": batch.tokens, "old_logprobs": batch.old_logprobs, "metrics": metrics, "grads": grads}


def test_an_rl_step_at_cp2_samples_and_trains_as_one_process():
    """The CP ranks generate half of the prompts each and exchange the samples: both hold the batch one
    process samples, its old log-probs, and the update's loss and gradients."""
    (single,) = run_distributed(_rl_step, 1, None)
    width = single["tokens"].shape[1]
    for result in run_distributed(_rl_step, 2, {"context_parallel_size": 2}):
        # Rows under CP are padded to a multiple of 2 x CP: the extra columns are padding.
        assert torch.equal(result["tokens"][:, :width], single["tokens"])
        assert not result["tokens"][:, width:].any()
        _assert_same(single, {**result, "old_logprobs": result["old_logprobs"][:, :width - 1]}, "RL step at CP = 2")


def _te_fp8_gemm_accepts(tokens: int, features: int) -> bool:
    """Transformer Engine's rule for the input of an FP8 GEMM ([tokens, features]): tokens a multiple of 8
    and features of 16 (its Linear's check before an FP8 product)."""
    return tokens % 8 == 0 and features % 16 == 0


@pytest.mark.parametrize("tp, sp, cp", [(1, False, 1), (2, True, 1), (4, True, 1), (8, True, 1), (2, False, 1),
                                        (1, False, 2), (2, True, 2), (8, True, 4), (4, False, 3)])
def test_fp8_rows_give_every_gemm_a_multiple_of_16_tokens(tp, sp, cp):
    """Under precision.fp8, every packed or padded row width (any length, any bins) gives each CP rank a
    multiple of 16 tokens (what its GEMMs see, gathered over TP), which TE's FP8 rule accepts; the
    zigzag chunks and the sequence-parallel shards still divide it. Without FP8 the widths stay as small
    as TP x 2 CP allows (a 7-token row at TP 2 + SP is 8 wide, not 16)."""
    from megacispo.parallel.layout import ParallelConfig
    from megacispo.training.packing import FP8_TOKEN_MULTIPLE, pack_rows, row_length_multiple

    parallel = ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp, context_parallel_size=cp)
    multiple = row_length_multiple(parallel, fp8=True)
    for length in range(1, 200):
        padded = -(-length // multiple) * multiple
        (row,) = pack_rows([length, 1], 2, 2 * length + 1, 1, multiple, torch.device("cpu"))
        for width in (padded, row.width):
            tokens = width // cp
            assert width % cp == 0 and tokens % FP8_TOKEN_MULTIPLE == 0 and _te_fp8_gemm_accepts(tokens, 6144)
            assert cp == 1 or width % (2 * cp) == 0
            assert not sp or tokens % tp == 0
    if (tp, sp, cp) == (2, True, 1):
        assert row_length_multiple(parallel, fp8=False) == 2 and multiple == 16


@pytest.fixture(scope="module")
def padded_m2() -> dict:
    """cispo on all 16 sequences right-padded in one micro-batch, in one process, on the tiny M2."""
    (result,) = run_distributed(_pass, 1, False, 0, "cispo", None, False, "tiny-m2")
    return result


@pytest.mark.parametrize("layout, world", [(None, 1), ({"context_parallel_size": 2}, 2)], ids=["packed", "cp2"])
def test_m2_packed_rows_compute_what_one_process_computes(padded_m2, layout, world):
    """MiniMax-M2 (QK-norm, sigmoid routing with its selection bias, routing replay of recorded experts):
    5 packed micro-batches in one process and split over 2 CP ranks, against the padded rows of one
    process. (TP, EP and PP build other initial weights: megacispo.score and the layout matrix compare
    them from one checkpoint.)"""
    for result in run_distributed(_pass, world, True, _budget_for(5), "cispo", layout, False, "tiny-m2"):
        assert result["micro_batches"] == 5
        _assert_same(padded_m2, result, f"M2 {layout}")


@pytest.mark.parametrize("rate", [0.0, 0.01])
def test_m2_selection_bias_moves_toward_equal_loads_only_when_asked(rate):
    """model.moe_router_bias_update_rate: one update moves each selection bias by the rate, up for an
    expert that took fewer than the mean tokens, down for one that took more (Megatron's aux-loss-free
    balancing); at 0 (RL's default) every bias stays as loaded."""
    (result,) = run_distributed(_pass, 1, True, _budget_for(2), "cispo", None, False, "tiny-m2",
                                moe_router_bias_update_rate=rate)
    biases = result["expert_biases"]
    assert len(biases) == 8
    for name, bias in biases.items():
        if rate == 0.0:
            assert torch.equal(bias, torch.zeros_like(bias)), name
        else:
            step = torch.tensor(rate, dtype=bias.dtype)
            assert bool(((bias == 0) | (bias.abs() == step)).all()), (name, bias)
    if rate:
        moved = torch.stack(list(biases.values()))
        assert bool((moved > 0).any()) and bool((moved < 0).any()), "some experts were under, some over the mean load"
