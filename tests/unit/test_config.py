"""The run config: YAML + dotted overrides, typed, validated once with errors that name the field."""

from pathlib import Path

import pytest
import torch

from megacispo.config import Config, parse_override, to_dict
from megacispo.startup import (
    POSITION_BYTES,
    SAMPLE_OBJECT_BYTES,
    check_rl_batches,
    check_sft_batches,
    rollout_bytes,
    run_config,
)

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples" / "configs").glob("*.yaml"))


def test_defaults_are_the_m1_recipe():
    config = run_config(None)
    assert config.rl.loss.name == "cispo"
    assert config.rl.loss.params["eps_low"] == 1.0 and config.rl.loss.params["eps_high"] == 4.0
    assert (config.optimizer.adam_beta1, config.optimizer.adam_beta2, config.optimizer.adam_eps) == (0.9, 0.95, 1e-15)
    assert config.model.num_layers == 8 and config.model.layer_pattern.startswith("LLLLLLLS")


def test_yaml_and_dotted_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  size: tiny\n  num_layers: 16\nrl:\n  loss:\n    name: dapo\ntrain:\n  steps: 3\n")
    config = run_config(str(path), ["train.steps=5", "rl.loss.params.eps_high=0.3", "optimizer.lr=1e-3",
                                      "parallel.sequence_parallel=true", "parallel.tensor_model_parallel_size=2"])
    assert config.model.num_layers == 16
    assert config.train.steps == 5
    assert config.rl.loss.name == "dapo" and config.rl.loss.params == {"eps_low": 0.2, "eps_high": 0.3}
    assert config.optimizer.lr == 1e-3 and isinstance(config.optimizer.lr, float)
    assert config.parallel.sequence_parallel is True


def test_resolved_config_round_trips():
    config = run_config(None, ["train.steps=7"])
    assert isinstance(to_dict(config)["model"], dict)
    assert to_dict(config)["train"]["steps"] == 7


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.grup_size=4", r"config.rollout.grup_size: unknown field; valid fields of config.rollout: .*group_size"),
        ("train.steps=many", r"config.train.steps: expected int, got 'many'"),
        ("train.steps=0", r"train.steps = 0: it must be >= 1"),
        ("sft.decay_steps=-5", r"sft.decay_steps = -5: it must be >= 0"),
        ("rollout.group_size=1", r"rollout.group_size = 1"),
        ("rollout.top_p=1.5", r"rollout.top_p = 1.5: it must be in \(0, 1\]"),
        ("rollout.top_k=-5", r"rollout.top_k = -5: it must be >= 0 \(0: off\)"),
        ("optimizer.lr=-1", r"optimizer.lr = -1.0: it must be > 0"),
        ("optimizer.lr=.nan", r"config.optimizer.lr: expected a finite number, got nan"),
        ("optimizer.lr=inf", r"config.optimizer.lr: expected a finite number, got 'inf'"),
        ("optimizer.adam_beta2=1", r"optimizer.adam_beta2 = 1.0: it must be in \[0, 1\)"),
        ("optimizer.min_lr=0.1", r"optimizer.min_lr = 0.1 exceeds optimizer.lr = 0.0001"),
        ("rl.max_reward_failure_frac=2", r"rl.max_reward_failure_frac = 2.0: it must be in \[0, 1\]"),
        ("rl.reward=nope", r"rl.reward: reward 'nope': unknown reward name"),
        ("train.run_dir=''", r"train.run_dir is empty"),
        ("data.overlong_prompts=cut", r"data.overlong_prompts = 'cut': use error, skip, truncate_left"),
        ("rollout.max_new_tokens=4096", r"rollout.max_new_tokens = 4096 leaves no room for a prompt"),
        ("data.max_prompt_tokens=4090", r"data.max_prompt_tokens = 4090 \+ rollout.max_new_tokens = 16 exceeds"),
        ("rl.loss.name=ppo", r"rl.loss.name = 'ppo': use one of cispo, dapo, grpo, gspo, reinforce"),
        ("rl.loss.params.eps_hgh=1", r"rl.loss: unknown parameter\(s\) eps_hgh"),
        ("rl.old_logprobs=cached", r"rl.old_logprobs = 'cached'"),
        ("model.size=huge", r"config.model: model size 'huge' is unknown"),
        ("model.num_layrs=2", r"config.model.num_layrs: unknown field"),
        ("parallel.tensor_model_parallel_size=two", r"config.parallel.tensor_model_parallel_size: expected int"),
    ],
)
def test_bad_config_names_the_field(override, message):
    with pytest.raises(ValueError, match=message):
        run_config(None, [override])


def test_override_syntax_and_missing_file():
    with pytest.raises(ValueError, match="expected key=value"):
        parse_override("train.steps")
    with pytest.raises(ValueError, match="no such file"):
        run_config("/nonexistent/run.yaml")


def test_yaml_syntax_errors_name_the_place(tmp_path):
    with pytest.raises(ValueError, match=r"^--set 'train.steps=\[1': invalid YAML at line 1, column 3: "):
        parse_override("train.steps=[1")
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  steps: 3\n   seed: 1\n")
    with pytest.raises(ValueError, match=rf"^--config {path}: invalid YAML at line 3, column 8: ") as error:
        run_config(str(path))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("text, message", [
    ("rollout:\n  group_size: 4\ntrain:\n  steps: 2\nrollout:\n  top_k: 5\n",
     "duplicate key 'rollout' at line 5, column 1 (first at line 1)"),
    ("rl:\n  loss:\n    name: dapo\n    name: grpo\n",
     "duplicate key 'rl.loss.name' at line 4, column 5 (first at line 3)"),
    ("rl:\n  loss: {name: dapo, name: grpo}\n", "duplicate key 'rl.loss.name' at line 2, column 22 (first at line 2)"),
    ("logging:\n  metric_hooks:\n    - {a: 1, a: 2}\n",
     "duplicate key 'logging.metric_hooks[0].a' at line 3, column 14 (first at line 3)"),
])
def test_a_key_written_twice_is_an_error_naming_both_lines(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        run_config(str(path))
    assert str(error.value) == f"--config {path}: {message}: YAML would keep only the last; keep one"


def test_a_key_written_twice_in_an_override_is_an_error():
    # The column counts in the value, as a syntax error's does.
    with pytest.raises(ValueError, match=r"^--set 'rl=\{a: 1, a: 2\}': duplicate key 'a' at line 1, column 8 "):
        parse_override("rl={a: 1, a: 2}")


def test_merged_and_aliased_keys_are_not_duplicates():
    """Only keys written in the mapping itself count: a merge (<<) brings in keys to override."""
    assert parse_override("train={<<: {steps: 2, seed: 3}, steps: 5}")[1] == {"steps": 5, "seed": 3}
    assert parse_override("x=[&a {k: 1}, *a]")[1] == [{"k": 1}, {"k": 1}]


def test_rollout_memory_is_bounded_from_the_samples():
    """Per sample, its Python objects and each of 1 + max_new_tokens positions' tokens, log-probs and
    expert routes; the rollout cache of every sample at once unless rollout.max_running bounds it."""
    config = run_config(None, ["rollout.max_new_tokens=9"])
    model = config.model
    held, cache = rollout_bytes(config, 1000)
    per_position = POSITION_BYTES + model.num_layers * model.moe_router_topk  # uint8 routes
    assert held == 1000 * (SAMPLE_OBJECT_BYTES + 10 * per_position)
    bounded = rollout_bytes(run_config(None, ["rollout.max_new_tokens=9", "rollout.max_running=10"]), 1000)
    assert bounded[0] == held and bounded[1] * 100 == cache


def test_rollout_samples_beyond_host_memory_are_refused(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match=r"rollout.group_size = 100000000 puts 400000000 samples on each process"):
        check_rl_batches(run_config(None, ["rollout.group_size=100000000", "rollout.max_running=64"]), 2)
    # 3.2M samples hold a few GiB: their cache, every sample's at once, is what no machine holds.
    config = run_config(None, ["rollout.group_size=800000", "rollout.prompts_per_step=8"])
    check_rl_batches(config, 2)
    if torch.cuda.is_available():
        return
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cache = r"for the rollout cache of rollout.max_running = 0 \(every sample at once\), "
    with pytest.raises(ValueError, match=cache + r".* GiB for the 2 process\(es\) on this machine, .*: set rollout"):
        check_rl_batches(config, 2)


def test_prompt_limit_defaults_to_what_the_context_leaves():
    assert run_config(None).max_prompt_tokens == 4096 - 16
    assert run_config(None, ["data.max_prompt_tokens=100"]).max_prompt_tokens == 100


@pytest.mark.parametrize(
    "overrides, data_parallel_size, message",
    [
        ([], 1, None),
        (["rollout.prompts_per_step=3"], 2, r"rollout.prompts_per_step = 3 is not divisible by the data-parallel size"),
        (["rl.updates_per_rollout=3"], 1, r"rl.updates_per_rollout = 3 does not divide the 64 samples"),
        (["rl.updates_per_rollout=8"], 4, None),
        (["rl.updates_per_rollout=32"], 4, r"rl.updates_per_rollout = 32 does not divide the 16 samples"),
        (["train.pack_sequences=false", "train.micro_batch_size=3"], 1,
         r"train.micro_batch_size = 3 does not divide the 16 samples of each update"),
        (["train.micro_batch_size=3"], 1, None),  # packed rows take whole sequences up to a token budget
        (["train.pack_sequences=false", "train.micro_batch_size=64"], 1, None),  # one micro-batch
        (["train.max_tokens_per_micro_batch=4096", "data.max_prompt_tokens=1024"], 1, None),
        (["train.max_tokens_per_micro_batch=1000", "data.max_prompt_tokens=1024"], 1,
         r"train.max_tokens_per_micro_batch = 1000 is less than the longest sequence, \d+ tokens"),
    ],
)
def test_rl_batches_split_over_the_data_parallel_ranks(overrides, data_parallel_size, message):
    config = run_config(None, overrides)  # 8 prompts x 8 samples, 4 updates, micro-batches of 8
    if message is None:
        check_rl_batches(config, data_parallel_size)
        return
    with pytest.raises(ValueError, match=message):
        check_rl_batches(config, data_parallel_size)


def test_a_token_budget_needs_packed_rows():
    with pytest.raises(ValueError, match=r"train.max_tokens_per_micro_batch = 4096 is a budget of packed micro-batches "
                                         r"but train.pack_sequences is false"):
        run_config(None, ["train.max_tokens_per_micro_batch=4096", "train.pack_sequences=false"])


def test_sft_batches_split_over_the_data_parallel_ranks():
    check_sft_batches(run_config(None, ["sft.batch_size=64"]), 8)  # 8 pairs a rank, one micro-batch
    with pytest.raises(ValueError, match=r"sft.batch_size = 6 is not divisible by the data-parallel size 4"):
        check_sft_batches(run_config(None, ["sft.batch_size=6"]), 4)
    with pytest.raises(ValueError, match=r"train.micro_batch_size = 8 does not divide the 12 pairs of each SFT step"):
        check_sft_batches(run_config(None, ["sft.batch_size=24", "train.pack_sequences=false"]), 2)
    check_sft_batches(run_config(None, ["sft.batch_size=24"]), 2)  # packed rows take any number of pairs


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_configs_load(path):
    assert isinstance(run_config(str(path)), Config)


def test_compile_decode_refuses_a_layout_it_cannot_trace():
    layout = "parallel.pipeline_model_parallel_size=2"
    run_config(None, [layout])  # the layout alone is valid
    message = r"needs parallel.pipeline_model_parallel_size = 1, got 2"
    with pytest.raises(ValueError, match=rf"rollout.compile_decode = true {message}.*rollout.compile_decode=false"):
        run_config(None, ["rollout.compile_decode=true", layout])
    assert run_config(None, ["rollout.compile_decode=true"]).rollout.compile_decode
    parallel = ["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=2"]
    assert run_config(None, ["rollout.compile_decode=true", *parallel]).rollout.compile_decode


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.pack_sequences=false"], r"parallel.context_parallel_size = 2 splits packed rows over its ranks, but "
                                         r"train.pack_sequences is false"),
        (["logging.metric_hooks.probe_token.token=x"], r"parallel.context_parallel_size = 2 with logging.metric_hooks"),
        (["placement.rollout_ranks=1"], r"parallel.context_parallel_size = 2 with placement.rollout_ranks = 1"),
    ],
)
def test_context_parallelism_refuses_what_it_would_split(overrides, message):
    with pytest.raises(ValueError, match=message):
        run_config(None, ["parallel.context_parallel_size=2", *overrides])


@pytest.mark.parametrize("loss", ["gspo", "grpo"])
def test_context_parallelism_takes_the_sequence_mean_losses(loss):
    """Their per-sequence sums span the CP ranks (tests/multiprocess/test_cp_score.py)."""
    assert run_config(None, ["parallel.context_parallel_size=2", f"rl.loss.name={loss}"]).rl.loss.name == loss


def test_context_parallel_ranks_share_the_prompts_of_their_data_parallel_rank():
    check_rl_batches(run_config(None, ["parallel.context_parallel_size=2", "rollout.prompts_per_step=8"]), 2)
    config = run_config(None, ["parallel.context_parallel_size=2", "rollout.prompts_per_step=6"])
    with pytest.raises(ValueError, match=r"rollout.prompts_per_step = 6 gives each of the 2 data-parallel ranks 3 "
                                         r"prompts, which its parallel.context_parallel_size = 2 ranks cannot share"):
        check_rl_batches(config, 2)


def test_context_parallel_comm_names_its_choices():
    with pytest.raises(ValueError, match=r"parallel.context_parallel_comm = 'ring': use one of all_gather, p2p"):
        run_config(None, ["parallel.context_parallel_size=2", "parallel.context_parallel_comm=ring"])
    ring = ["parallel.context_parallel_size=2", "parallel.context_parallel_comm=p2p"]
    assert run_config(None, ring).parallel.context_parallel_comm == "p2p"
