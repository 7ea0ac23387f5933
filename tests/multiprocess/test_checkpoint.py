"""Checkpoints of a tiny Megatron GPTModel in real gloo processes: saved at TP=2 with the distributed
optimizer, loaded at TP=2 and at TP=1 x DP=2 (same weights, the run continues as if uninterrupted,
RNG restored on the same layout), kept to the newest N, and never half-written: a save killed before
its final rename leaves the previous checkpoint as the latest, and it loads (plain optimizer). Its MoE
variant resumes across expert-parallel sizes, which change Megatron's chain of optimizers."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from megacispo.checkpoint.distributed import (
    checkpoint_dir,
    find_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from megacispo.parallel.sharded import TensorPiece, assemble
from megacispo.testing.harness import run_distributed

SEQ_LEN = 16
VOCAB = 128
BATCH = 4
LR = 1e-2
TP2 = {"tensor_model_parallel_size": 2}
CONFIG = {"model": {"hidden_size": 32, "num_layers": 2}, "train": {"steps": 3, "keep_last": 2}}
NUM_EXPERTS = 4
EP2 = {"expert_model_parallel_size": 2}


def _extra_state(step: int) -> dict:
    return {"consumed_samples": BATCH * step, "sampler": {"epoch": 0, "position": 3 * step}, "best_reward": 0.25}


def _build(distributed_optimizer: bool, num_experts: int | None = None):
    """A tiny GPTModel in Megatron DDP, its Adam optimizer and LR scheduler (parallel state is up);
    with ``num_experts``, its MLPs are MoE layers split across the expert-parallel ranks."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer import TransformerConfig

    moe = dict(
        num_moe_experts=num_experts, moe_router_topk=2, moe_aux_loss_coeff=1e-3, moe_token_dispatcher_type="alltoall",
        moe_router_dtype="fp32", expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
    ) if num_experts else {}
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=True, pipeline_dtype=torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, **moe,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts),
                     vocab_size=VOCAB, max_sequence_length=SEQ_LEN)
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer)
    ddp_model = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, min_lr=LR / 10, weight_decay=0.1, adam_beta1=0.9,
                        adam_beta2=0.95, adam_eps=1e-15, use_distributed_optimizer=distributed_optimizer,
                        clip_grad=1.0),
        [ddp_model],
    )
    # Warm-up then cosine: the learning rate differs at every step, so a scheduler that was not
    # restored changes the next update.
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=LR, min_lr=LR / 10, lr_warmup_steps=1, lr_decay_steps=6,
        lr_decay_style="cosine", start_wd=0.1, end_wd=0.1, wd_incr_steps=6, wd_incr_style="constant",
    )
    return ddp_model, optimizer, scheduler


def _init(layout: dict) -> None:
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    init_distributed(ParallelConfig(**layout), seed=1234)


def _train_step(ddp_model, optimizer, scheduler, step: int) -> torch.Tensor:
    """One optimizer step on a batch fixed by ``step`` (no dropout: training draws no random numbers);
    returns its loss (every data-parallel rank takes the whole batch)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(100 + step))
    position_ids = torch.arange(SEQ_LEN).unsqueeze(0)

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch[:, :-1], position_ids, None, labels=batch[:, 1:])

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            # Cloned: the schedule divides the returned loss in place by the number of micro-batches.
            return loss, {"loss": loss.detach().clone()}

        return output, loss_func

    (losses,) = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([tokens]), model=[ddp_model],
        num_microbatches=1, seq_length=SEQ_LEN, micro_batch_size=BATCH,
    )
    update_successful, _, _ = optimizer.step()
    assert update_successful
    scheduler.step(increment=1)
    return losses["loss"]


def _draws() -> dict:
    """One draw from every generator a checkpoint restores."""
    from megatron.core import tensor_parallel

    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracked = torch.rand(4)
    return {"torch": torch.rand(4), "tracker": tracked, "python": random.random(), "numpy": float(np.random.rand())}


def _scramble_rng() -> None:
    from megatron.core import tensor_parallel

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    tensor_parallel.model_parallel_cuda_manual_seed(99)


def _params(ddp_model):
    from megacispo.parallel.sharded import parameter_pieces

    return parameter_pieces(ddp_model.module)


def _save_run(root: str) -> dict:
    """TP=2, distributed optimizer: three steps, a checkpoint after each, keep_last=2."""
    _init(TP2)
    ddp_model, optimizer, scheduler = _build(distributed_optimizer=True)
    result = {}
    for step in (1, 2, 3):
        _train_step(ddp_model, optimizer, scheduler, step)
        save_checkpoint(root, step, ddp_model, optimizer, scheduler, extra_state=_extra_state(step),
                        config_dict=CONFIG, keep_last=2)
        if step == 2:
            result.update(params2=_params(ddp_model), draws=_draws(), lr=optimizer.param_groups[0]["lr"])
    result["params3"] = _params(ddp_model)
    return result


def _load_run(path: str, layout: dict, resave_root: str | None) -> dict:
    """Load the step-2 checkpoint at ``layout`` and take step 3. Then, without ``resave_root``,
    take step 3 again from the same weights with a fresh optimizer (a control: the comparison sees
    the optimizer state); with it, save step 3 there at this layout, load that into a second model,
    and take step 4 with both."""
    _init(layout)
    ddp_model, optimizer, scheduler = _build(distributed_optimizer=True)
    _scramble_rng()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        meta = load_checkpoint(path, ddp_model, optimizer, scheduler)
    result = {
        "meta": meta,
        "params2": _params(ddp_model),
        "draws": _draws(),
        "lr": optimizer.param_groups[0]["lr"],
        "rng_warnings": [str(w.message) for w in caught if "RNG states" in str(w.message)],
    }
    _train_step(ddp_model, optimizer, scheduler, 3)
    result["params3"] = _params(ddp_model)
    second_model, second_optimizer, second_scheduler = _build(distributed_optimizer=True)
    if resave_root is None:
        load_checkpoint(path, second_model, load_rng=False)
        _train_step(second_model, second_optimizer, second_scheduler, 3)
        result["params3_fresh_optimizer"] = _params(second_model)
    else:
        resaved = save_checkpoint(resave_root, 3, ddp_model, optimizer, scheduler)
        load_checkpoint(resaved, second_model, second_optimizer, second_scheduler)
        for model, model_optimizer, model_scheduler in ((ddp_model, optimizer, scheduler),
                                                        (second_model, second_optimizer, second_scheduler)):
            _train_step(model, model_optimizer, model_scheduler, 4)
        result.update(params4=_params(ddp_model), params4_resaved=_params(second_model))
    return result


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp2_run")
    (result0, result1) = run_distributed(_save_run, 2, str(root))
    return root, [result0, result1]


def _max_relative_error(expected: dict, actual: dict) -> float:
    assert expected.keys() == actual.keys()
    return max(
        float((expected[key] - actual[key]).abs().max() / expected[key].abs().max().clamp_min(1e-12))
        for key in expected
    )


def _updates(results: list[dict]) -> dict:
    """The step-3 update of every parameter, full tensors."""
    before = assemble([r["params2"] for r in results])
    after = assemble([r["params3"] for r in results])
    return {key: after[key] - before[key] for key in before}


def test_save_writes_meta_and_keeps_last(tp2_run):
    root, _ = tp2_run
    assert sorted(path.name for path in root.iterdir()) == ["step_00000002", "step_00000003"]
    assert latest_checkpoint(root) == checkpoint_dir(root, 3)
    step2 = checkpoint_dir(root, 2)
    assert sorted(path.name for path in (step2 / "rng").iterdir()) == ["rank_0.pt", "rank_1.pt"]
    meta = json.loads((step2 / "meta.json").read_text())
    assert meta["step"] == 2 and meta["world_size"] == 2
    assert meta["parallel"]["tensor_model_parallel_size"] == 2
    assert meta["extra_state"] == _extra_state(2)
    assert meta["config"] == CONFIG
    assert meta["scheduler"]["num_steps"] == 2


def test_load_at_tp2_continues_as_uninterrupted(tp2_run):
    root, saved = tp2_run
    loaded = run_distributed(_load_run, 2, str(checkpoint_dir(root, 2)), TP2, None)
    assert loaded[0]["meta"]["step"] == 2
    assert loaded[0]["meta"]["extra_state"] == _extra_state(2)
    # Same weights, same optimizer state and learning rate: the next step is bit-identical.
    assert _max_relative_error(assemble([r["params2"] for r in saved]), assemble([r["params2"] for r in loaded])) == 0
    assert _max_relative_error(_updates(saved), _updates(loaded)) == 0
    assert loaded[0]["lr"] == saved[0]["lr"]
    fresh = _updates([{"params2": r["params2"], "params3": r["params3_fresh_optimizer"]} for r in loaded])
    assert _max_relative_error(_updates(saved), fresh) > 0.1
    # Each rank gets its own RNG states back (the tracker's differ between TP ranks).
    for rank in range(2):
        assert loaded[rank]["rng_warnings"] == []
        for name, value in saved[rank]["draws"].items():
            assert torch.equal(torch.as_tensor(loaded[rank]["draws"][name]), torch.as_tensor(value)), (rank, name)
    assert not torch.equal(saved[0]["draws"]["tracker"], saved[1]["draws"]["tracker"])


def test_load_at_tp1_dp2_reshards_weights_and_optimizer(tp2_run, tmp_path):
    """TP=2 x DP=1 -> TP=1 x DP=2: the distributed optimizer's state is re-split along another axis."""
    root, saved = tp2_run
    loaded = run_distributed(_load_run, 2, str(checkpoint_dir(root, 2)), {}, str(tmp_path))
    assert _max_relative_error(assemble([r["params2"] for r in saved]), assemble([r["params2"] for r in loaded])) == 0
    # TP=1 sums in another order than TP=2: the update agrees to float32 rounding (measured 6e-6).
    assert _max_relative_error(_updates(saved), _updates(loaded)) < 5e-5
    assert loaded[0]["lr"] == saved[0]["lr"]
    assert loaded[0]["meta"]["extra_state"] == _extra_state(2)
    for result in loaded:
        (message,) = result["rng_warnings"]
        assert "'tensor_model_parallel_size': 2" in message and "'tensor_model_parallel_size': 1" in message
    # Saved again at DP=2 and loaded: the next step is bit-identical.
    resaved = {key: assemble([r[key] for r in loaded]) for key in ("params4", "params4_resaved")}
    assert _max_relative_error(resaved["params4"], resaved["params4_resaved"]) == 0


# ---------------------------------------------------------------------------------------------
# Resuming at another expert-parallel size
# ---------------------------------------------------------------------------------------------


def _chain(optimizer) -> list:
    return getattr(optimizer, "chained_optimizers", [optimizer])


def _adam_steps(optimizer) -> set[float]:
    """torch AdamW's step of every parameter of every optimizer of the chain."""
    return {float(state["step"]) for sub in _chain(optimizer) for state in sub.optimizer.state.values()}


def _sharded_leaves(state):
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    if isinstance(state, dict):
        return [leaf for value in state.values() for leaf in _sharded_leaves(value)]
    if isinstance(state, (list, tuple)):
        return [leaf for value in state for leaf in _sharded_leaves(value)]
    if isinstance(state, ShardedTensorFactory):
        return _sharded_leaves(state.build())
    return [state]


def _moments(ddp_model, optimizer) -> list[TensorPiece]:
    """This rank's pieces of every parameter's Adam moments, keyed ``exp_avg.<parameter key>`` and
    ``exp_avg_sq.<parameter key>`` whatever the layout: the optimizer's sharded state dict, as a save
    builds it (the distributed optimizer gathers each data-parallel group's moments on its rank 0)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megacispo.checkpoint.distributed import sharded_metadata

    metadata = sharded_metadata()
    model_state = ddp_model.module.sharded_state_dict(metadata=metadata)
    prefix = "optimizer.state."
    return [
        TensorPiece(key=leaf.key.removeprefix(prefix), data=leaf.data.detach().clone(),
                    global_shape=tuple(leaf.global_shape), global_offset=tuple(leaf.global_offset),
                    prepend_axis_num=leaf.prepend_axis_num)
        for leaf in _sharded_leaves(optimizer.sharded_state_dict(model_state, metadata=metadata))
        if isinstance(leaf, ShardedTensor) and leaf.key.startswith((f"{prefix}exp_avg.", f"{prefix}exp_avg_sq."))
    ]


def _moe_state(ddp_model, optimizer) -> dict:
    return {"params2": _params(ddp_model), "moments2": _moments(ddp_model, optimizer),
            "steps2": _adam_steps(optimizer), "lr": optimizer.param_groups[0]["lr"], "chain": len(_chain(optimizer))}


def _moe_save_run(root: str, layout: dict) -> dict:
    """The MoE model at ``layout`` with the distributed optimizer: two steps, the checkpoint of step 2,
    then step 3 (the uninterrupted run)."""
    _init(layout)
    ddp_model, optimizer, scheduler = _build(distributed_optimizer=True, num_experts=NUM_EXPERTS)
    for step in (1, 2):
        _train_step(ddp_model, optimizer, scheduler, step)
    save_checkpoint(root, 2, ddp_model, optimizer, scheduler, config_dict=CONFIG)
    result = _moe_state(ddp_model, optimizer)
    result["loss3"] = _train_step(ddp_model, optimizer, scheduler, 3)
    result["params3"] = _params(ddp_model)
    return result


def _moe_resume_run(path: str, layout: dict) -> dict:
    """Resume the MoE model's checkpoint at ``layout`` and take step 3; then, a control, step 3 again
    from the same weights and learning rate with a fresh optimizer."""
    _init(layout)
    ddp_model, optimizer, scheduler = _build(distributed_optimizer=True, num_experts=NUM_EXPERTS)
    load_checkpoint(path, ddp_model, optimizer, scheduler, load_rng=False)
    result = _moe_state(ddp_model, optimizer)
    result["loss3"] = _train_step(ddp_model, optimizer, scheduler, 3)
    result.update(params3=_params(ddp_model), steps3=_adam_steps(optimizer))
    second_model, second_optimizer, second_scheduler = _build(distributed_optimizer=True, num_experts=NUM_EXPERTS)
    load_checkpoint(path, second_model, scheduler=second_scheduler, load_rng=False)
    _train_step(second_model, second_optimizer, second_scheduler, 3)
    result["params3_fresh_optimizer"] = _params(second_model)
    return result


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep2_run")
    return checkpoint_dir(root, 2), run_distributed(_moe_save_run, 2, str(root), EP2)


@pytest.fixture(scope="module")
def ep1_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep1_run")
    return checkpoint_dir(root, 2), run_distributed(_moe_save_run, 1, str(root), {})


def _assert_resumes(saved: list[dict], resumed: list[dict]) -> None:
    """The resumed optimizer holds the saved one's state, and its next step is the uninterrupted run's."""
    assert saved[0]["chain"] != resumed[0]["chain"], "the layouts build the same chain of optimizers"
    assert _max_relative_error(assemble([r["params2"] for r in saved]), assemble([r["params2"] for r in resumed])) == 0
    # Every parameter's moments, on the parameter they belong to, and Adam's step.
    moments = assemble([r["moments2"] for r in saved])
    assert len(moments) == 2 * len(assemble([r["params2"] for r in saved]))
    assert _max_relative_error(moments, assemble([r["moments2"] for r in resumed])) == 0
    assert {step for r in saved for step in r["steps2"]} == {step for r in resumed for step in r["steps2"]} == {2.0}
    assert {step for r in resumed for step in r["steps3"]} == {3.0}
    assert resumed[0]["lr"] == saved[0]["lr"]
    # Step 3 at the new layout: the loss and update of the uninterrupted run (at the saved layout), to
    # float32 rounding (the layouts sum in other orders; measured 8e-7).
    losses = {float(r["loss3"]) for r in saved + resumed}
    assert max(losses) - min(losses) <= 1e-5 * max(losses)
    assert _max_relative_error(_updates(saved), _updates(resumed)) < 5e-5
    # The control: the same step with fresh moments and step is another update.
    fresh = _updates([{"params2": r["params2"], "params3": r["params3_fresh_optimizer"]} for r in resumed])
    assert _max_relative_error(_updates(saved), fresh) > 0.1


@pytest.mark.parametrize("world_size", [1, 2], ids=["ep1", "ep1_dp2"])
def test_ep2_checkpoint_resumes_at_ep1(ep2_run, world_size):
    """EP=2 (a dense and an expert optimizer) -> EP=1 (one optimizer), on 1 process and at DP=2."""
    path, saved = ep2_run
    _assert_resumes(saved, run_distributed(_moe_resume_run, world_size, str(path), {}))


def test_ep1_checkpoint_resumes_at_ep2(ep1_run):
    """EP=1 (one optimizer) -> EP=2 (a dense and an expert optimizer)."""
    path, saved = ep1_run
    _assert_resumes(saved, run_distributed(_moe_resume_run, 2, str(path), EP2))


# ---------------------------------------------------------------------------------------------
# The optimizer state a save gathers
# ---------------------------------------------------------------------------------------------


def _save_as_on_a_gpu(root: str) -> dict:
    """TP=1 x DP=2, distributed optimizer, one step, then the save a GPU run makes (torch.cuda.is_available()
    answers True, as there): the Adam moments each rank gathers for it and the bytes of its own shard of
    them; then the checkpoint loaded into a fresh optimizer, and the moments it holds."""
    from unittest import mock

    _init({})
    ddp_model, optimizer, scheduler = _build(distributed_optimizer=True)
    _train_step(ddp_model, optimizer, scheduler, 1)
    shard_bytes = sum(state[key].nbytes for sub in _chain(optimizer) for state in sub.optimizer.state.values()
                      for key in ("exp_avg", "exp_avg_sq"))
    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        gathered = _moments(ddp_model, optimizer)
        save_checkpoint(root, 1, ddp_model, optimizer, scheduler, config_dict=CONFIG)
    second_model, second_optimizer, second_scheduler = _build(distributed_optimizer=True)
    load_checkpoint(checkpoint_dir(root, 1), second_model, second_optimizer, second_scheduler, load_rng=False)
    return {"gathered": gathered, "shard_bytes": shard_bytes, "params": _params(ddp_model),
            "loaded": _moments(second_model, second_optimizer)}


def test_a_gpu_save_gathers_the_optimizer_state_on_data_parallel_rank_0_alone(tmp_path):
    """The distributed optimizer's state reaches the host memory of DP rank 0 only (the whole of it, which
    it writes); DP rank 1 gathers nothing beyond its own shard, and the checkpoint loads the same moments."""
    saved = run_distributed(_save_as_on_a_gpu, 2, str(tmp_path))
    gathered = [sum(piece.data.nbytes for piece in result["gathered"]) for result in saved]
    num_params = sum(tensor.numel() for tensor in assemble([r["params"] for r in saved]).values())
    # exp_avg and exp_avg_sq in float32 of every parameter, on rank 0; the ranks' own shards split them.
    assert gathered == [2 * 4 * num_params, 0]
    assert sum(result["shard_bytes"] for result in saved) == gathered[0]
    assert _max_relative_error(assemble([r["gathered"] for r in saved]), assemble([r["loaded"] for r in saved])) == 0


# ---------------------------------------------------------------------------------------------
# Crash safety
# ---------------------------------------------------------------------------------------------


def _save_until_killed(root: str, params_file: str, ready_file: str) -> None:
    """Saves step 1, takes step 2 and starts saving it, then waits to be killed right before the
    rename that would commit it (the test's own patch of the commit step, in this process only)."""
    os.setpgrp()  # the test kills this process and the checkpoint writer's helper process together
    from megacispo.checkpoint import distributed

    _init({})
    ddp_model, optimizer, scheduler = _build(distributed_optimizer=False)
    _train_step(ddp_model, optimizer, scheduler, 1)
    save_checkpoint(root, 1, ddp_model, optimizer, scheduler, extra_state=_extra_state(1))
    _train_step(ddp_model, optimizer, scheduler, 2)
    torch.save(_params(ddp_model), params_file)

    def wait_for_kill(temporary: Path, final: Path, aside_prefix: str) -> None:
        Path(ready_file).touch()
        time.sleep(600)

    distributed.publish_directory = wait_for_kill
    save_checkpoint(root, 2, ddp_model, optimizer, scheduler, extra_state=_extra_state(2))


def _resume_after_crash(root: str, params_file: str, broken_dirs: list[str]) -> dict:
    """Resume from the latest checkpoint (plain optimizer), check step 2 and save it again."""
    _init({})
    ddp_model, optimizer, scheduler = _build(distributed_optimizer=False)
    errors = {}
    for broken in broken_dirs:
        with pytest.raises(ValueError) as error:
            load_checkpoint(broken, ddp_model, optimizer, scheduler)
        errors[broken] = str(error.value)
    path = latest_checkpoint(root)
    meta = load_checkpoint(path, ddp_model, optimizer, scheduler)
    _train_step(ddp_model, optimizer, scheduler, 2)
    expected = torch.load(params_file, weights_only=False)
    save_checkpoint(root, 2, ddp_model, optimizer, scheduler, extra_state=_extra_state(2))
    return {"path": str(path), "meta": meta, "errors": errors, "expected": expected, "params": _params(ddp_model)}


def test_killed_save_leaves_previous_checkpoint(tmp_path):
    root = tmp_path / "run"
    params_file, ready_file = tmp_path / "params_step2.pt", tmp_path / "ready"
    process = mp.get_context("spawn").Process(
        target=_save_until_killed, args=(str(root), str(params_file), str(ready_file))
    )
    process.start()
    try:
        deadline = time.monotonic() + 300
        while not ready_file.exists():
            assert process.is_alive(), f"the saving process exited early with code {process.exitcode}"
            assert time.monotonic() < deadline, "the saving process never reached the commit"
            time.sleep(0.1)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.join()

    # The killed save had written everything, meta.json included, into its temporary directory.
    temporary = root / ".tmp_step_00000002"
    assert (temporary / "meta.json").is_file()
    assert latest_checkpoint(root) == checkpoint_dir(root, 1)
    # Decoys: a copy of a valid checkpoint under a temporary name with a file removed, and a newer
    # step_* directory without meta.json.
    shutil.copytree(checkpoint_dir(root, 1), root / ".tmp_step_00000007")
    (root / ".tmp_step_00000007" / "rng" / "rank_0.pt").unlink()
    shutil.copytree(checkpoint_dir(root, 1), checkpoint_dir(root, 9), ignore=shutil.ignore_patterns("meta.json"))
    assert latest_checkpoint(root) == checkpoint_dir(root, 1)
    # Damaged checkpoints elsewhere: only meta.json; everything but this rank's RNG file.
    only_meta = tmp_path / "only_meta" / "step_00000001"
    only_meta.mkdir(parents=True)
    shutil.copy(checkpoint_dir(root, 1) / "meta.json", only_meta)
    no_rng = tmp_path / "no_rng" / "step_00000001"
    shutil.copytree(checkpoint_dir(root, 1), no_rng, ignore=shutil.ignore_patterns("rng"))

    broken = [str(checkpoint_dir(root, 9)), str(only_meta), str(no_rng)]
    (resumed,) = run_distributed(_resume_after_crash, 1, str(root), str(params_file), broken)
    assert resumed["path"] == str(checkpoint_dir(root, 1))
    assert resumed["meta"]["step"] == 1 and resumed["meta"]["extra_state"] == _extra_state(1)
    assert _max_relative_error(assemble([resumed["expected"]]), assemble([resumed["params"]])) == 0
    assert "no meta.json" in resumed["errors"][broken[0]] and broken[0] in resumed["errors"][broken[0]]
    assert f"{only_meta / '.metadata'} is missing" in resumed["errors"][broken[1]]
    assert "rng/rank_0.pt" in resumed["errors"][broken[2]]
    # The next save removed what the killed one left behind and committed step 2.
    assert not [path.name for path in root.iterdir() if path.name.startswith(".tmp_")]
    assert latest_checkpoint(root) == checkpoint_dir(root, 2)


def test_save_rejects_bad_arguments_before_writing(tmp_path):
    with pytest.raises(ValueError, match="extra_state must be plain JSON"):
        save_checkpoint(tmp_path, 1, model=None, extra_state={"consumed": torch.tensor(3)})
    with pytest.raises(ValueError, match="keep_last = 0"):
        save_checkpoint(tmp_path, 1, model=None, keep_last=0)
    assert list(tmp_path.iterdir()) == []


def test_latest_checkpoint_orders_steps_and_needs_meta(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    for step in (9, 10, 100):
        checkpoint_dir(tmp_path, step).mkdir()
    for step in (9, 10):
        (checkpoint_dir(tmp_path, step) / "meta.json").write_text("{}")
    (tmp_path / ".tmp_step_00000200").mkdir()
    (tmp_path / ".tmp_step_00000200" / "meta.json").write_text("{}")
    (tmp_path / "step_latest").mkdir()
    found = find_checkpoints(tmp_path)
    assert list(found) == [checkpoint_dir(tmp_path, step) for step in (9, 10, 100)]
    assert "format_version None" in found[checkpoint_dir(tmp_path, 10)]
    assert "no meta.json" in found[checkpoint_dir(tmp_path, 100)]
    assert latest_checkpoint(tmp_path) is None
    with pytest.raises(ValueError, match=f"{checkpoint_dir(tmp_path, 100)} is not a megacispo checkpoint"):
        load_checkpoint(checkpoint_dir(tmp_path, 100), model=None)
    with pytest.raises(ValueError, match="format_version"):
        load_checkpoint(checkpoint_dir(tmp_path, 10), model=None)


def test_publish_replaces_a_step_saved_before(tmp_path):
    """A resumed run that saves a step it had saved before: the new checkpoint wins, nothing is left over."""
    from megacispo.files import publish_directory

    final = checkpoint_dir(tmp_path, 5)
    temporary = tmp_path / ".tmp_step_00000005"
    for directory, content in ((final, "old"), (temporary, "new")):
        directory.mkdir()
        (directory / "meta.json").write_text(content)
    publish_directory(temporary, final)
    assert (final / "meta.json").read_text() == "new"
    assert [path.name for path in tmp_path.iterdir()] == ["step_00000005"]


def test_params_dtype_comes_from_the_runs_precision():
    from megacispo.checkpoint.distributed import params_dtype_of

    # Training and conversion both record it in the run's config (converted: the HF weights' dtype).
    assert params_dtype_of({"config": {"precision": {"params_dtype": "bfloat16"}}}) == "bfloat16"
    assert params_dtype_of({"config": {"model": {}}}) == "float32"
