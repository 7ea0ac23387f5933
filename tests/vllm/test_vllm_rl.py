"""RL steps with rollout.engine = vllm (``bash tests/run.sh --vllm``): vLLM in every training process of a tiny
MiniMax-M2 (head_dim 32: vLLM's CPU attention has no kernel for 16), started from its config.json alone and
given every weight by the trainer, at 1 process, TP 2 and PP 2, at EP 2 with one vLLM engine over both
processes (rollout.vllm_tensor_parallel = 2), with LoRA adapters at TP 2 (merged into the weights it sends), and
in the slow tier at CP 2; megacispo.train's run below is at
EP 2 with an engine per process:

- after the start's sync and the step's, vLLM's log-probs of the probe equal the trainer's to 1e-3 (fp32; the
  run's bound is 1e-2);
- vLLM's log-probs of the tokens it sampled are the training engine's old log-probs of them (the
  mismatch/* metrics), so its samples come from the weights being trained;
- after every weight moved (further than a step moves them), a planted bad sync, one tensor not sent or one
  expert's rows in another's place, on one rank only, is caught on every rank with an error naming the
  rank, the probe position and both log-probs, and a good sync after it passes;
- megacispo.train stops with that error, one line and exit code 2, before it trains on the samples of the
  bad weights.
"""

from __future__ import annotations

import re

import pytest

from megacispo.testing.harness import run_distributed, run_entry_point

pytest.importorskip("vllm")

MODEL = {"model.size": "tiny-m2", "model.head_dim": 32, "model.rotary_dim": 16, "model.num_layers": 4}
LAYOUTS = {
    "one process": ({}, 1),
    "TP 2": ({"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": True}, 2),
    "PP 2": ({"parallel.pipeline_model_parallel_size": 2}, 2),
    # One vLLM engine over both processes: its weights split over them, each rank's prompts gathered.
    "EP 2, vLLM TP 2": ({"parallel.expert_model_parallel_size": 2, "rollout.vllm_tensor_parallel": 2}, 2),
    # LoRA adapters (TP 2 splits them, the experts' too): vLLM gets the weights with the adapters merged in.
    "LoRA, TP 2": ({"parallel.tensor_model_parallel_size": 2, "parallel.sequence_parallel": True, "lora.rank": 4,
                    "train.load": "unused"}, 2),
    # Each CP rank generates its share of the prompts with its own engine (bash tests/run.sh --vllm --slow).
    "CP 2": ({"parallel.context_parallel_size": 2}, 2),
}
SKIPPED = "model.layers.1.self_attn.o_proj.weight"
SWAPPED = ("model.layers.2.block_sparse_moe.experts.0.w1.weight", "model.layers.2.block_sparse_moe.experts.1.w1.weight")
MISMATCH_TOLERANCE = 1e-4  # |vLLM's sampled log-prob - the trainer's old log-prob| (fp32)
ERROR = (r"rank 0 \(of [12] that failed\) after the sync of step \d+: vLLM's weights are not the trainer's after the "
         r"update: its log-prob of probe sequence \d+'s token \d+ is -?\d+\.\d+, the trainer's -?\d+\.\d+ "
         r"\(\|difference\| [\d.e+-]+ > 0.01\)")


def _overrides(data, run_dir, layout: dict) -> list[str]:
    pairs = {**MODEL, **layout, "rollout.engine": "vllm", "rollout.vllm_cache_gib": 0.25,
             "data.train_prompts": data / "train.jsonl", "data.test_prompts": data / "test.jsonl",
             "data.tokenizer": data / "tok" / "tokenizer.model", "rollout.prompts_per_step": 4,
             "rollout.group_size": 4, "rollout.max_new_tokens": 6, "rl.updates_per_rollout": 2,
             "rl.reward": "megacispo.testing.reward_fixtures:odd_length", "optimizer.lr": 3e-3,
             "optimizer.use_distributed_optimizer": False, "train.run_dir": run_dir, "train.micro_batch_size": 4,
             "rollout.dynamic_sampling": False}
    return [f"{key}={value}" for key, value in pairs.items()]


def _faulty(fault: str):
    """vllm_engine.hf_weights on rank 0 with ``fault`` planted: SKIPPED left out, or SWAPPED's rows exchanged."""
    import torch.distributed as dist

    from megacispo.rollout import vllm_engine

    sound = vllm_engine.hf_weights

    def weights(config, tensors):
        named = dict(sound(config, tensors))
        if dist.get_rank() == 0 and fault == "skipped":
            del named[SKIPPED]
        elif dist.get_rank() == 0:
            named[SWAPPED[0]], named[SWAPPED[1]] = named[SWAPPED[1]], named[SWAPPED[0]]
        return iter(named.items())

    return weights


def _move(module) -> None:
    """Every weight moved, as an update moves them but further (a tensor left out of the sync keeps its value
    of the last one), the same on every replica of a weight (one seed, every rank's parameters in one order)."""
    import torch

    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))


def _steps_on_vllm(overrides: list[str]) -> dict:
    """vLLM started and synced, an RL step (synced after its update), then the planted bad syncs (each after
    the weights moved) and a good one: the metrics of each sync and step, and the bad syncs' errors."""
    from megacispo.config import load_config
    from megacispo.rollout import vllm_engine
    from megacispo.startup import check_config
    from megacispo.testing.trainers import build_trainer

    config = check_config(load_config(None, overrides))
    trainer = build_trainer(config)
    trainer.start_vllm()
    result = {"start": trainer._sync_vllm(0), "steps": [trainer.rl_step()]}
    trainer.step += 1
    sound, result["caught"] = vllm_engine.hf_weights, {}
    for fault in ("skipped", "swapped"):
        _move(trainer.engine.module)
        vllm_engine.hf_weights = _faulty(fault)
        try:
            trainer._sync_vllm(trainer.step)
            result["caught"][fault] = None
        except vllm_engine.WeightSyncError as error:
            result["caught"][fault] = str(error)
        finally:
            vllm_engine.hf_weights = sound
    result["after the bad ones"] = trainer._sync_vllm(trainer.step)
    return result


@pytest.fixture(scope="module", params=[pytest.param(name, marks=pytest.mark.slow) if name == "CP 2" else name
                                        for name in LAYOUTS])
def run(request, task_files, tmp_path_factory) -> list[dict]:
    layout, world = LAYOUTS[request.param]
    overrides = _overrides(task_files, tmp_path_factory.mktemp("run"), layout)
    return run_distributed(_steps_on_vllm, world, overrides, timeout_s=600)


def test_every_sync_gives_vllm_the_trainers_weights(run):
    for rank in run:
        syncs = [rank["start"], *rank["steps"], rank["after the bad ones"]]
        assert all(sync["rollout/vllm_probe_max_abs_diff"] <= 1e-3 for sync in syncs), syncs
        assert all(sync["perf/weight_sync_s"] > 0 for sync in syncs)


def test_vllm_samples_from_the_weights_being_trained(run):
    for rank in run:
        for step in rank["steps"]:
            assert step["mismatch/abs_logp_diff_max"] <= MISMATCH_TOLERANCE, step
            assert step["rollout/response_length_mean"] > 0


def test_a_bad_sync_on_one_rank_is_caught_on_every_rank(run):
    for rank in run:
        for fault, message in rank["caught"].items():
            assert message is not None, f"the {fault} sync was not caught"
            assert re.match(ERROR, message), message


def _train_with_a_bad_sync(argv: list[str]) -> dict:
    from megacispo.rollout import vllm_engine

    syncs = []
    sound = vllm_engine.hf_weights

    def second_sync_skips(config, tensors):
        syncs.append(None)
        return _faulty("skipped")(config, tensors) if len(syncs) == 2 else sound(config, tensors)

    vllm_engine.hf_weights = second_sync_skips
    return run_entry_point("megacispo.train", argv)


def test_the_run_stops_at_a_bad_sync_with_one_line(task_files, tmp_path):
    """The start's sync is sound, step 1's skips a tensor on rank 0: the run stops there, saying so."""
    overrides = _overrides(task_files, tmp_path / "run", {"parallel.expert_model_parallel_size": 2})
    argv = [arg for override in [*overrides, "train.steps=3", "train.eval_every=0", "train.checkpoint_every=0"]
            for arg in ("--set", override)]
    results = run_distributed(_train_with_a_bad_sync, 2, argv, timeout_s=600)
    for result in results:
        assert result["code"] == 2, result
    errors = [line for line in results[0]["err"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.match("error: " + ERROR.replace("\\d+: vLLM", "1: vLLM"), errors[0]), errors
    assert not (tmp_path / "run" / "checkpoints").exists()
