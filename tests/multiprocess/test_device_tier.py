"""The device tier: a tensor that a GPU run would hold in host memory by mistake (a factory call
without ``device=`` or with ``device="cpu"``, a ``.cpu()``, a generator made without a device, a host
tensor handed to a collective) is caught on this CPU-only machine, before a GPU step crashes on it.

Two checks, because here the CPU is both the run's device and host memory:

- The driver under ``device_guard.host_memory_guard`` (tests/support/device_guard.py): the run's device
  stays the CPU, what a GPU run would put in host memory is marked, and an op that meets marked and
  unmarked tensors raises DeviceMismatch. Real values flow, so the whole driver runs, data-dependent
  control flow included, in a gloo world of one at TP = PP = EP = 1: building the engine and the
  trainer; an RL step (rollouts through ``generate``: prefill, lean decode steps, sampling with
  top-k / top-p, early truncation, rewards, overlong shaping, advantages; the old-log-prob pass; the
  update with ``Engine.token_logprobs``, ``compute_policy_loss``, Megatron's forward and backward
  and the distributed optimizer's step; the metrics' collectives), evaluation (greedy and sampled),
  decode steps through Megatron's modules (``lean_decode = False``), score's forward, and one SFT step
  (``megacispo.sft.main`` with bf16 weights, its checkpoint save included). A host tensor planted
  in each path (a wrapper that adds a host zero to one function's output, or moves it with
  ``.cpu()``, or the sampler's keys or a collective's flag made without a device) is caught.
- Pure tensor math on the ``meta`` device, where a CPU tensor fails on contact whatever made it,
  ``torch.device("cpu")`` objects included, which the guard cannot tell from the run's device: the
  policy loss, the vocab-parallel log-probs and the fused LM head (forward and backward), RMSNorm,
  RoPE and the lightning decode step.

Not covered: TP, PP, EP > 1 and sequence parallelism (their collectives, p2p sends and the
sequence-parallel switch of decode steps), Transformer Engine and FP8, bf16 weights in RL (SFT runs
them), activation recompute, the Triton lightning kernel, anything under torch.compile
(``rollout.compile_decode``), dynamic sampling's extra rounds, checkpoint loading and resuming,
score's checkpoint conversion and file I/O, convert.py, work on other threads, and on ``meta`` the
block-wise lightning kernel, the mixers' and the MoE's forward (lightning checks its decay values,
lightning_checks.py ``check_decay``; the MoE reads token counts with .tolist()). The guard does not see a
tensor placed with a ``torch.device("cpu")`` object outside the meta-checked math, tensors made
outside torch's Python API (``torch.from_numpy``, ``torch.LongTensor(...)``), nor host tensors that
Megatron-Core or torch make themselves (``host_memory_guard`` says why).
"""

from __future__ import annotations

import contextlib
import traceback
from pathlib import Path

import pytest
import torch

from megacispo.testing.device_guard import DeviceMismatch, host_memory_guard
from megacispo.testing.harness import run_distributed

# This module's own calls are in the guard's scope too: the planted mistakes are made here.
SCOPE = ("megacispo", __name__)
MISMATCH = "DeviceMismatch"


# ---------------------------------------------------------------------------------------------
# The guard on single ops


def _host_zero_added(t: torch.Tensor) -> torch.Tensor:
    return t + torch.zeros(())


def _host_copy_used(t: torch.Tensor) -> torch.Tensor:
    return t * t.cpu()


def _named_host_used(t: torch.Tensor) -> torch.Tensor:
    return t - torch.ones(4, device="cpu")


def _moved_to_host_used(t: torch.Tensor) -> torch.Tensor:
    return t - torch.ones(4, device=t.device).to("cpu")


def _host_index(t: torch.Tensor) -> torch.Tensor:
    return t.index_select(0, torch.tensor([0]))


def _host_generator(t: torch.Tensor) -> torch.Tensor:
    return torch.multinomial(t.abs() + 1, 1, generator=torch.Generator().manual_seed(0))


class _BackwardMakesHostTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * torch.ones(grad.shape)


def _host_tensor_in_backward(t: torch.Tensor) -> None:
    _BackwardMakesHostTensor.apply(t.detach().requires_grad_()).sum().backward()


MISPLACEMENTS = [_host_zero_added, _host_copy_used, _named_host_used, _moved_to_host_used, _host_index,
                 _host_generator, _host_tensor_in_backward]


@pytest.mark.parametrize("misplacement", MISPLACEMENTS, ids=lambda f: f.__name__)
def test_guard_catches_each_misplacement(misplacement):
    tensor = torch.randn(4)
    with host_memory_guard(SCOPE), pytest.raises(DeviceMismatch):
        misplacement(tensor)


def test_guard_lets_host_bookkeeping_and_explicit_transfers_run():
    tensor = torch.randn(4)
    with host_memory_guard(SCOPE):
        counts = torch.tensor([1, 2, 3])
        # Host-only use, as on a GPU run.
        assert counts.sum().item() == 6 and counts.tolist() == [1, 2, 3] and f"{counts.float().mean():.1f}" == "2.0"
        moved = torch.zeros(4).to(tensor.device) + tensor
        on_device = torch.zeros(4, device=tensor.device) + torch.zeros_like(tensor) + tensor.new_ones(4)
        tensor.clone().copy_(torch.ones(4))
        drawn = torch.multinomial(tensor.abs() + 1, 1, generator=torch.Generator(device=tensor.device))
    assert type(moved) is type(on_device) is type(drawn) is torch.Tensor


def test_guard_follows_code_that_compares_devices():
    """Marked tensors report a device other than the run's: a lazy move happens as on a GPU run, and
    what is made on a marked tensor's device is in host memory too."""
    tensor = torch.randn(4)
    with host_memory_guard(SCOPE):
        rates = torch.ones(4)
        if rates.device != tensor.device:
            rates = rates.to(tensor.device)
        assert type(rates * tensor) is torch.Tensor
        with pytest.raises(DeviceMismatch):
            torch.arange(4, device=torch.zeros(1).device) + tensor


def test_guard_leaves_upstream_host_tensors_unmarked():
    """Megatron-Core and torch keep some tensors on the host on a GPU run too; only code in scope is checked."""
    tensor = torch.randn(4)
    with host_memory_guard(("megacispo",)):
        assert type(torch.zeros(4) + tensor) is torch.Tensor


# ---------------------------------------------------------------------------------------------
# The RL driver under the guard, in a world of one


def _rl_config(run_dir: str):
    from megacispo.config import Config
    from megacispo.evaluation.config import EvalConfig
    from megacispo.rl.config import RLConfig
    from megacispo.rollout.config import RolloutConfig
    from megacispo.training.config import TrainConfig

    # Every sampling branch (top-k, top-p, early truncation after 3 tokens of any probability) and
    # overlong shaping; one round of 2 prompts x 2 samples, updated in 2 micro-batches; evaluation
    # greedy and with 2 samples per prompt.
    rollout = RolloutConfig(prompts_per_step=2, group_size=2, max_new_tokens=4, top_k=50, top_p=0.9,
                            early_truncation_tokens=3, early_truncation_prob=0.0, dynamic_sampling=False)
    rl = RLConfig(updates_per_rollout=1, overlong_max_length=3, overlong_cache_length=1)
    return Config(rollout=rollout, rl=rl, train=TrainConfig(micro_batch_size=2, run_dir=run_dir),
                  eval=EvalConfig(num_samples=2))


def _build_trainer(run_dir: str):
    from megacispo.testing.trainers import build_trainer

    return build_trainer(_rl_config(run_dir))


def _megatron_decode(trainer) -> None:
    from megacispo.rollout.generate import generate, sample_keys

    model = trainer.engine.module
    model.lean_decode = False
    try:
        generate(model, [[1, 5, 6, 7], [1, 8]], trainer.config.rollout, stop_ids=[2], pad_id=0,
                 keys=sample_keys((0,), range(2), 1, device=trainer.engine.device),
                 lockstep_group=trainer.engine.groups.dp)
    finally:
        model.lean_decode = True


def _score_forward(trainer) -> None:
    from megacispo.evaluation.scoring import _sequence_logprobs

    model = trainer.engine.module.eval()
    try:
        _sequence_logprobs(model, [1, 5, 6, 7, 8], trainer.config.parallel)
    finally:
        model.train()


def _rl_scenarios(trainer) -> dict:
    """Each path of the RL driver, as a function of no arguments; the later phases reuse the batch
    of the clean rollout (``state``)."""
    state = {}

    def rollout():
        state["batch"], _ = trainer.collect_rollouts()

    def old_logprobs():
        state["batch"].old_logprobs = trainer.compute_old_logprobs(state["batch"])

    return {
        "rollout": rollout,
        "old_logprobs": old_logprobs,
        "update": lambda: trainer.update(state["batch"]),
        "rl_step": trainer.rl_step,
        "evaluate": trainer.evaluate,
        "megatron_decode": lambda: _megatron_decode(trainer),
        "score_forward": lambda: _score_forward(trainer),
    }


@contextlib.contextmanager
def _replaced(owner, name: str, value):
    original = owner.__dict__[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _with_mistake(function, mistake):
    """``function`` whose (first) tensor output goes through ``mistake`` before it is returned."""

    def planted(*args, **kwargs):
        result = function(*args, **kwargs)
        if isinstance(result, torch.Tensor):
            return mistake(result)
        first = next(i for i, value in enumerate(result) if isinstance(value, torch.Tensor))
        return (*result[:first], mistake(result[first]), *result[first + 1 :])

    return planted


def _planted(owner, name: str, mistake=_host_zero_added):
    planted = _with_mistake(getattr(owner, name), mistake)
    if isinstance(owner.__dict__[name], staticmethod):
        planted = staticmethod(planted)  # an autograd Function's backward
    return _replaced(owner, name, planted)


def _agree_with_host_flags(engine, refill: bool, replies: int, busy: bool, live_rows: int) -> tuple[bool, int, bool, int]:
    flags = torch.tensor([int(refill), replies, int(busy), live_rows])  # the mistake: no device=, then a collective
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=engine.group)
    return bool(flags[0]), int(flags[1]), bool(flags[2]), int(flags[3])


def _all_reduce_on_host(trainer, value: float, op=torch.distributed.ReduceOp.SUM) -> float:
    total = torch.tensor(value, dtype=torch.float64)  # the mistake: no device=, then a collective
    torch.distributed.all_reduce(total, op=op, group=trainer.engine.groups.dp)
    return float(total)


def _all_reduce_rows_on_host(rows, group, device):
    total = torch.tensor(rows, dtype=torch.float64)  # the mistake: no device=, then a collective
    torch.distributed.all_reduce(total, group=group)
    return total.tolist()


def _sample_keys_on_host(trainer, num_prompts: int) -> torch.Tensor:
    from megacispo.rollout.generate import sample_keys

    group_size = trainer.config.rollout.group_size
    return sample_keys((0,), range(num_prompts), group_size, device="cpu")  # the mistake: the host


def _rl_plants() -> dict:
    """name: (the scenario it runs, the plant). Each plant makes one host tensor in one path."""
    import megacispo.evaluation.evaluator
    import megacispo.evaluation.scoring
    import megacispo.models.lightning_mixer
    import megacispo.parallel.vocab_parallel
    import megacispo.rl.trainer
    import megacispo.rollout.generate
    import megacispo.training.engine
    from megacispo.models.lightning import _LightningAttentionFunction
    from megacispo.models.model import HybridModel
    from megacispo.parallel.vocab_parallel import _FusedLMHeadLogProbs
    from megacispo.rl.trainer import Trainer
    from megacispo.training.engine import Engine

    mixer = megacispo.models.lightning_mixer
    return {
        "prefill": ("rollout", _planted(HybridModel, "_megatron_stage")),
        "lean_decode_step": ("rollout", _planted(HybridModel, "_lean_stage")),
        "megatron_decode_step": ("megatron_decode", _planted(mixer, "lightning_state_step")),
        "sample_keys": ("rollout", _replaced(Trainer, "_sample_keys", _sample_keys_on_host)),
        "rollout_collective": ("rollout", _replaced(megacispo.rollout.generate._SlotRollout, "_agree", _agree_with_host_flags)),
        "advantages": ("rollout", _planted(megacispo.rl.trainer, "group_relative_advantages")),
        "old_logprobs_pass": ("old_logprobs", _planted(megacispo.rl.trainer, "broadcast_from_last_stage")),
        "training_forward": ("update", _planted(mixer, "lightning_attention")),
        "lightning_backward": ("update", _planted(_LightningAttentionFunction, "backward")),
        "lm_head_backward": ("update", _planted(_FusedLMHeadLogProbs, "backward")),
        "token_logprobs": ("update", _planted(megacispo.training.engine, "lm_head_logprobs")),
        "token_logprobs_moved_to_host": ("update", _planted(Engine, "token_logprobs", torch.Tensor.cpu)),
        "policy_loss": ("update", _planted(megacispo.rl.trainer, "compute_policy_loss")),
        "step_metrics": ("rl_step", _replaced(Trainer, "_all_reduce", _all_reduce_on_host)),
        "evaluation": ("evaluate", _replaced(megacispo.evaluation.evaluator, "_all_reduce_rows", _all_reduce_rows_on_host)),
        "score_forward": ("score_forward", _planted(megacispo.evaluation.scoring, "vocab_parallel_logprobs")),
    }


def _outcome(run) -> str:
    """'ok', or the error a run raised: 'DeviceMismatch: ...' or another error with its traceback."""
    try:
        run()
    except DeviceMismatch as error:
        return f"{MISMATCH}: {error}"
    except Exception:  # noqa: BLE001 - reported to the test, which names it
        return traceback.format_exc(limit=-8)
    return "ok"


def _rl_tier(run_dir: str) -> dict:
    """The clean scenarios (after building the trainer, "build"), then each plant's scenario with
    the plant in place: {"clean": {scenario: outcome}, "planted": {plant: (scenario, outcome)}}."""
    with host_memory_guard(SCOPE):
        built = {}
        clean = {"build": _outcome(lambda: built.update(trainer=_build_trainer(run_dir)))}
        if "trainer" not in built:
            return {"clean": clean, "planted": {}}
        scenarios = _rl_scenarios(built["trainer"])
        clean.update({name: _outcome(run) for name, run in scenarios.items()})
        planted = {}
        for name, (scenario, plant) in _rl_plants().items():
            with plant:
                planted[name] = (scenario, _outcome(scenarios[scenario]))
    return {"clean": clean, "planted": planted}


@pytest.fixture(scope="module")
def rl_outcomes(tmp_path_factory) -> dict:
    (outcomes,) = run_distributed(_rl_tier, 1, str(tmp_path_factory.mktemp("rl")))
    return outcomes


RL_SCENARIOS = ["build", "rollout", "old_logprobs", "update", "rl_step", "evaluate", "megatron_decode", "score_forward"]
RL_PLANTS = [
    "prefill", "lean_decode_step", "megatron_decode_step", "sample_keys", "rollout_collective", "advantages",
    "old_logprobs_pass", "training_forward", "lightning_backward", "lm_head_backward", "token_logprobs",
    "token_logprobs_moved_to_host", "policy_loss", "step_metrics", "evaluation", "score_forward",
]


@pytest.mark.parametrize("scenario", RL_SCENARIOS)
def test_rl_driver_runs_with_tensors_on_the_run_device(rl_outcomes, scenario):
    outcome = rl_outcomes["clean"].get(scenario, "not run: the trainer was not built")
    assert outcome == "ok", outcome


@pytest.mark.parametrize("plant", RL_PLANTS)
def test_planted_host_tensor_in_rl_driver_is_caught(rl_outcomes, plant):
    assert plant in rl_outcomes["planted"], "not run: the trainer was not built"
    scenario, outcome = rl_outcomes["planted"][plant]
    # Only a scenario that runs clean shows that the plant, not an earlier host tensor, was caught.
    assert rl_outcomes["clean"][scenario] == "ok", f"the clean {scenario} fails: {rl_outcomes['clean'][scenario]}"
    assert outcome.startswith(MISMATCH), outcome


# ---------------------------------------------------------------------------------------------
# One SFT step (the entry point) under the guard


def _sft_files(workspace: Path) -> list[str]:
    """The smallest SFT run: 2 pairs, one step of one micro-batch, a sentencepiece tokenizer; bf16
    weights, so that the casts and the optimizer of fp32 master weights run too (the RL world runs fp32)."""
    from megacispo.data.prompts import PromptRecord, format_jsonl
    from megacispo.data.tokenizer import train_sentencepiece
    from megacispo.files import atomic_write_text

    pairs = [PromptRecord(prompt=f"{i}+{i}=", answer=str(2 * i)) for i in range(2)]
    atomic_write_text(workspace / "pairs.jsonl", format_jsonl(pairs))
    atomic_write_text(workspace / "corpus.txt", "".join(f"{p.prompt}{p.answer}\n" for p in pairs))
    tokenizer = train_sentencepiece([workspace / "corpus.txt"], 300, workspace)
    settings = {"data.sft_pairs": workspace / "pairs.jsonl", "data.tokenizer": tokenizer, "sft.steps": 1,
                "sft.batch_size": 2, "train.micro_batch_size": 2, "train.run_dir": workspace / "run",
                "precision.params_dtype": "bfloat16"}
    return [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]


def _sft_step(argv: list[str]) -> None:
    from megacispo.parallel.layout import destroy_distributed
    from megacispo.sft import main

    try:
        assert main(argv) == 0
    finally:
        destroy_distributed()


def _sft_tier(workspace: str) -> dict[str, str]:
    from megacispo.training.engine import Engine

    argv = _sft_files(Path(workspace))
    with host_memory_guard(SCOPE):
        clean = _outcome(lambda: _sft_step(argv))
        with _planted(Engine, "token_logprobs"):
            planted = _outcome(lambda: _sft_step(argv))
    return {"clean": clean, "planted": planted}


@pytest.fixture(scope="module")
def sft_outcomes(tmp_path_factory) -> dict[str, str]:
    (outcomes,) = run_distributed(_sft_tier, 1, str(tmp_path_factory.mktemp("sft")))
    return outcomes


def test_sft_step_runs_with_tensors_on_the_run_device(sft_outcomes):
    assert sft_outcomes["clean"] == "ok", sft_outcomes["clean"]


def test_planted_host_tensor_in_sft_step_is_caught(sft_outcomes):
    assert sft_outcomes["clean"] == "ok", f"the clean SFT step fails: {sft_outcomes['clean']}"
    assert sft_outcomes["planted"].startswith(MISMATCH), sft_outcomes["planted"]


# ---------------------------------------------------------------------------------------------
# Pure tensor math on the meta device


META = torch.device("meta")


def _policy_loss() -> None:
    from megacispo.rl.losses import compute_global_counts, compute_policy_loss

    logprobs = torch.randn(4, 9, device=META, requires_grad=True)
    old_logprobs, loss_mask = torch.randn(4, 9, device=META), torch.ones(4, 9, device=META)
    counts = compute_global_counts([loss_mask], [old_logprobs], group=None)
    loss, _ = compute_policy_loss("cispo", logprobs, old_logprobs, torch.randn(4, device=META), loss_mask, counts)
    loss.backward()


def _vocab_parallel_logprobs() -> None:
    from megacispo.parallel.vocab_parallel import vocab_parallel_entropy, vocab_parallel_logprobs

    logits = torch.randn(3, 7, 50, device=META, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7), device=META)
    # check_targets reads the ids' values, which meta tensors do not have.
    vocab_parallel_logprobs(logits, targets, check_targets=False).sum().backward()
    vocab_parallel_entropy(logits)


def _fused_lm_head() -> None:
    from megacispo.parallel.vocab_parallel import lm_head_logprobs

    hidden = torch.randn(20, 64, device=META, requires_grad=True)
    weight = torch.randn(50, 64, device=META, requires_grad=True)
    targets = torch.randint(0, 50, (20,), device=META)
    # Tiles smaller than the call: the tile loop and the merge of statistics run; no default tile for meta.
    logprobs, _ = lm_head_logprobs(hidden, weight, targets, compute_entropy=True, check_targets=False,
                                   chunk_size=8, vocab_chunk_size=16)
    logprobs.sum().backward()


def _norm_and_rotary() -> None:
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.layers import RMSNorm, RotaryEmbedding, apply_rotary
    from megacispo.parallel.layout import ParallelConfig

    norm = RMSNorm(transformer_config(model_config("tiny"), ParallelConfig()), 64, 1e-6).to(META)
    hidden = torch.randn(3, 64, device=META, requires_grad=True)
    cos, sin = RotaryEmbedding(8, 10_000.0)(torch.arange(5, device=META)[None])
    rotated = apply_rotary(torch.randn(1, 4, 5, 16, device=META, requires_grad=True), cos, sin)
    (norm(hidden).sum() + rotated.sum()).backward()


def _lightning_decode_step() -> None:
    from megacispo.models.lightning import lightning_decay_rates, lightning_decode_step

    q, k, v = (torch.randn(2, 4, 16, device=META) for _ in range(3))
    lightning_decode_step(q, k, v, lightning_decay_rates(4, 0, 8).to(META), torch.zeros(2, 4, 16, 16, device=META))


def _explicit_cpu_tensor_added(t: torch.Tensor) -> torch.Tensor:
    # 1-dim: a 0-dim CPU tensor is a scalar that meta ops take, as CUDA ops do.
    return t + torch.zeros(1, device="cpu")


def _meta_plants():
    """name: (the math it runs, the plant): an explicit CPU tensor in one function of that math."""
    import megacispo.models.layers
    import megacispo.models.lightning
    import megacispo.parallel.vocab_parallel
    import megacispo.rl.losses

    return {
        "policy_loss": (_policy_loss, _planted(megacispo.rl.losses, "aggregate_loss", _explicit_cpu_tensor_added)),
        "vocab_parallel_logprobs": (_vocab_parallel_logprobs, _planted(
            megacispo.parallel.vocab_parallel, "_grad_of_logits", _explicit_cpu_tensor_added)),
        "fused_lm_head": (_fused_lm_head, _planted(
            megacispo.parallel.vocab_parallel, "_columns_targets", _explicit_cpu_tensor_added)),
        "norm_and_rotary": (_norm_and_rotary, _planted(
            megacispo.models.layers, "_rotate_half", _explicit_cpu_tensor_added)),
        "lightning_decode_step": (_lightning_decode_step, _planted(
            megacispo.models.lightning, "lightning_state_step", _explicit_cpu_tensor_added)),
    }


META_MATH = ["policy_loss", "vocab_parallel_logprobs", "fused_lm_head", "norm_and_rotary", "lightning_decode_step"]


@pytest.mark.parametrize("name", META_MATH)
def test_math_runs_on_meta(name):
    math, _ = _meta_plants()[name]
    assert _outcome(math) == "ok", _outcome(math)


@pytest.mark.parametrize("name", META_MATH)
def test_planted_cpu_tensor_in_math_on_meta_is_caught(name):
    math, plant = _meta_plants()[name]
    with plant, pytest.raises(RuntimeError, match="is not on the expected device"):
        math()
