"""The bad-input catalog (issue #27): what a new user gets wrong, and the one line each gets back.

Each row is a bad input given as a user gives it (the quick-start config at a world of 2 with a
small override, or a damaged file) with fragments of the error it must produce: the field, the
value and the fix. Every row must stop the entry point before a model is built, with exit code 2,
one ``error:`` line, no traceback, and nothing in the run directory. Rows run in-process as rank 0
of WORLD_SIZE=2 (config rows through ``--dry-run``, which checks every value and builds nothing;
data rows through a normal start that is stopped if it gets past the pre-flight); a few run as 2
real processes under torchrun (rewards that always fail: tests/slow/test_bad_inputs.py). The workspace
and the launches are megacispo.testing.bad_inputs. Checkpoint, resume and preemption inputs have
their own tests.
"""

from __future__ import annotations

import re

import pytest

from megacispo import sft, train
from megacispo.parallel import layout
from megacispo.testing.bad_inputs import quick, run_argv, torchrun

ENTRY_POINTS = {"train": train, "sft": sft}

# What the quick start's context leaves a prompt: model.max_position_embeddings 4096 - rollout.max_new_tokens 6.
DEFAULT_BOUND = "data.max_prompt_tokens = 4090 (model.max_position_embeddings 4096 - rollout.max_new_tokens 6)"
# Context parallelism over the world of 2, the experts whole on each rank.
CP2 = ("parallel.context_parallel_size=2", "parallel.expert_model_parallel_size=1")


def config_row(entry: str, argv: list[str], *fragments: str, id: str):
    """A row the config checks catch: run with --dry-run."""
    return pytest.param(entry, [*argv, "--dry-run"], fragments, id=id)


def data_row(entry: str, argv: list[str], *fragments: str, id: str):
    """A row only the data checks catch (prompt files, tokenizer): run as a real start."""
    return pytest.param(entry, argv, fragments, id=id)


CATALOG = [
    # -- values out of range, NaN, infinity --------------------------------------------------------
    config_row("train", quick("optimizer.lr=-1"), "optimizer.lr = -1.0: it must be > 0", id="lr-negative"),
    config_row("train", quick("optimizer.lr=.nan"), "config.optimizer.lr: expected a finite number, got nan",
               id="lr-nan"),
    config_row("train", quick("optimizer.lr=inf"), "config.optimizer.lr: expected a finite number, got 'inf'",
               id="lr-inf"),
    config_row("train", quick("optimizer.weight_decay=-0.1"), "optimizer.weight_decay = -0.1: it must be >= 0",
               id="weight-decay-negative"),
    config_row("train", quick("optimizer.adam_beta1=1.5"), "optimizer.adam_beta1 = 1.5: it must be in [0, 1)",
               id="beta1-above-1"),
    config_row("train", quick("optimizer.min_lr=0.01"),
               "optimizer.min_lr = 0.01 exceeds optimizer.lr = 0.0002", "lower min_lr", id="min-lr-above-lr"),
    config_row("train", quick("optimizer.clip_grad=-1"), "optimizer.clip_grad = -1.0: it must be >= 0 (0: off)",
               id="clip-negative"),
    config_row("train", quick("rollout.top_k=-5"), "rollout.top_k = -5: it must be >= 0 (0: off)", id="top-k-negative"),
    config_row("train", quick("rollout.top_p=0"), "rollout.top_p = 0.0: it must be in (0, 1]", id="top-p-zero"),
    config_row("train", quick("rollout.temperature=-0.5"), "rollout.temperature = -0.5: it must be >= 0 (0: greedy)",
               id="temperature-negative"),
    config_row("train", quick("rollout.group_size=1"), "rollout.group_size = 1: it must be >= 2",
               "at least 2 samples per prompt", id="group-of-one"),
    config_row("train", quick("rollout.early_truncation_prob=2"),
               "rollout.early_truncation_prob = 2.0: it must be in [0, 1]", id="truncation-prob-above-1"),
    config_row("train", quick("rl.max_reward_failure_frac=1.5"),
               "rl.max_reward_failure_frac = 1.5: it must be in [0, 1] (1: never stop)", id="failure-frac-above-1"),
    config_row("train", quick("train.seed=-1"), "train.seed = -1: it must be >= 0", id="seed-negative"),
    config_row("train", quick("train.keep_last=0"), "train.keep_last = 0: it must be >= 1", id="keep-none"),
    config_row("train", quick("train.steps=0"), "train.steps = 0: it must be >= 1", id="no-steps"),
    config_row("sft", quick("sft.lr=0"), "sft.lr = 0.0: it must be > 0", id="sft-lr-zero"),
    # -- batches that do not split over the data-parallel ranks or into micro-batches ----------------
    config_row("train", quick("rollout.prompts_per_step=1"),
               "rollout.prompts_per_step = 1 is not divisible by the data-parallel size 2", "use a multiple of 2",
               id="prompts-below-dp"),
    config_row("train", quick("rollout.prompts_per_step=63"),
               "rollout.prompts_per_step = 63 is not divisible by the data-parallel size 2", id="prompts-odd"),
    config_row("train", quick("rl.updates_per_rollout=3"),
               "rl.updates_per_rollout = 3 does not divide the 256 samples of each data-parallel rank",
               "choose a divisor of 256", id="updates-do-not-divide"),
    config_row("train", quick("train.pack_sequences=false", "train.micro_batch_size=24"),
               "train.micro_batch_size = 24 does not divide the 64 samples of each update", "choose a divisor of 64",
               id="micro-batch-does-not-divide"),
    config_row("train", quick("train.max_tokens_per_micro_batch=100"),
               "train.max_tokens_per_micro_batch = 100 is less than the longest sequence", id="token-budget-too-small"),
    config_row("train", quick("parallel.context_parallel_size=2", "train.pack_sequences=false"),
               "parallel.context_parallel_size = 2 splits packed rows over its ranks, but train.pack_sequences is false",
               id="cp-unpacked"),
    config_row("sft", quick("sft.batch_size=3"), "sft.batch_size = 3 is not divisible by the data-parallel size 2",
               id="sft-batch-odd"),
    config_row("sft", quick("train.pack_sequences=false", "sft.batch_size=96"),
               "train.micro_batch_size = 32 does not divide the 48 pairs of each SFT step", id="sft-micro-batch"),
    # -- lengths against the model's context ------------------------------------------------------
    config_row("train", quick("rollout.max_new_tokens=5000"),
               "rollout.max_new_tokens = 5000 leaves no room for a prompt", "model.max_position_embeddings = 4096",
               "lower it below 4096", id="responses-beyond-context"),
    config_row("train", quick("data.max_prompt_tokens=4095"),
               "data.max_prompt_tokens = 4095 + rollout.max_new_tokens = 6 exceeds",
               "data.max_prompt_tokens = 0 takes what the context leaves, 4090", id="prompt-limit-beyond-context"),
    config_row("train", quick("data.max_prompt_tokens=-1"), "data.max_prompt_tokens = -1: it must be >= 0",
               id="prompt-limit-negative"),
    config_row("train", quick("data.overlong_prompts=cut"),
               "data.overlong_prompts = 'cut': use error, skip, truncate_left", id="overlong-policy-unknown"),
    # -- names: rewards, losses, fields, layout ----------------------------------------------------
    config_row("train", quick("rl.reward=exact"), "rl.reward: reward 'exact': unknown reward name", "exact_match",
               id="reward-unknown"),
    config_row("train", quick("rl.reward=no_such_module_xyz:score"),
               "rl.reward: reward 'no_such_module_xyz:score'", "not found; put its directory on PYTHONPATH",
               id="reward-module-missing"),
    config_row("train", quick("rl.reward=catalog_rewards:missing"), "rl.reward: ",
               "module 'catalog_rewards' has no attribute 'missing'", id="reward-function-missing"),
    config_row("train", quick("rl.reward=catalog_rewards:one_argument"),
               "'one_argument' cannot be called as fn(response, record)", id="reward-wrong-signature"),
    config_row("train", quick("rl.reward=catalog_broken_rewards:score"),
               "importing module 'catalog_broken_rewards' failed", id="reward-module-broken"),
    config_row("train", quick("rl.loss.name=ppo"), "rl.loss.name = 'ppo': use one of cispo, dapo, grpo, gspo, reinforce",
               id="loss-unknown"),
    config_row("train", quick("rl.loss.params.eps_hgh=4"), "rl.loss: unknown parameter(s) eps_hgh",
               id="loss-param-typo"),
    config_row("train", quick("train.stepz=3"), "config.train.stepz: unknown field", "steps", id="field-typo"),
    config_row("train", quick("train.steps=many"), "config.train.steps: expected int, got 'many'", id="steps-text"),
    config_row("train", quick("parallel.expert_model_parallel_size=3"), "world size 2", "expert_model_parallel_size",
               id="layout-ep-3"),
    # -- memory: a batch far past any machine's (the bound is this machine's memory) ------------------
    config_row("train", quick("rollout.group_size=100000000", "rollout.max_running=256"),
               "rollout.prompts_per_step = 64 x rollout.group_size = 100000000 puts 3200000000 samples on each process",
               "at least", "GiB of host memory per process for their tokens, log-probs and expert routes",
               "lower rollout.group_size or rollout.prompts_per_step", id="rollout-samples-beyond-host-memory"),
    # -- the command line and the config file ------------------------------------------------------
    config_row("train", quick("train.steps=[1"), "--set 'train.steps=[1': invalid YAML at line 1, column 3",
               id="set-yaml-syntax"),
    config_row("train", quick("train.steps"), "--set 'train.steps': expected key=value", id="set-without-value"),
    config_row("train", ["--config", "{ws}/syntax.yaml"], "syntax.yaml: invalid YAML at line 3, column 1",
               id="config-yaml-syntax"),
    config_row("train", ["--config", "{ws}/list.yaml"], "the top level must be a mapping of sections",
               id="config-list"),
    config_row("train", ["--config", "{ws}/scalar_section.yaml"],
               "config.rollout: expected a mapping of RolloutConfig fields, got 5", id="config-section-scalar"),
    config_row("train", ["--config", "{ws}/missing.yaml"], "missing.yaml: no such file", id="config-missing"),
    config_row("train", ["--config", "{ws}/duplicate_section.yaml"],
               "duplicate_section.yaml: duplicate key 'rollout' at line 5, column 1 (first at line 1)", "keep one",
               id="config-duplicate-section"),
    config_row("train", ["--config", "{ws}/duplicate_key.yaml"],
               "duplicate_key.yaml: duplicate key 'rollout.group_size' at line 4, column 3 (first at line 2)",
               id="config-duplicate-key"),
    config_row("train", ["--config", "{ws}/latin1.yaml"], "latin1.yaml: not UTF-8", "save it as UTF-8",
               id="config-not-utf8"),
    # -- data: prompt files and the tokenizer ------------------------------------------------------
    data_row("train", ["--config", "{ws}/empty.yaml"], "data.tokenizer is not set",
             "--set data.tokenizer=PATH", id="config-empty"),
    data_row("train", quick("data.train_prompts=''"), "data.train_prompts is not set", id="prompts-unset"),
    data_row("train", quick("logging.metric_hooks.probe_token.token='12'"),
             "logging.metric_hooks.probe_token.token: '12' encodes to 2 tokens",
             "choose a text that is one token of data.tokenizer", id="probe-token-two-tokens"),
    data_row("train", quick("data.train_prompts={ws}/nope.jsonl"), "data.train_prompts: prompt file",
             "nope.jsonl' does not exist", id="prompts-missing"),
    data_row("train", quick("data.train_prompts={ws}/bad_json.jsonl"), "data.train_prompts: ",
             "bad_json.jsonl:2: invalid JSON", id="prompts-bad-json"),
    data_row("train", quick("data.train_prompts={ws}/empty.jsonl"), "data.train_prompts: ", "no records",
             id="prompts-empty"),
    data_row("train", quick("data.train_prompts={ws}/long.jsonl"), "data.train_prompts: ",
             "long.jsonl:1: the prompt ([BOS] + prompt) is", f"tokens, more than {DEFAULT_BOUND}",
             "set data.overlong_prompts to skip or truncate_left", id="prompt-5000-tokens"),
    data_row("train", quick("data.train_prompts={ws}/huge.jsonl"), "huge.jsonl:1: the prompt ([BOS] + prompt) is",
             id="prompts-8x100000-tokens"),
    data_row("train", quick("data.train_prompts={ws}/long.jsonl", "data.max_prompt_tokens=100"),
             "tokens, more than data.max_prompt_tokens = 100; shorten it", id="prompt-beyond-set-limit"),
    data_row("train", quick("data.train_prompts={ws}/long8.jsonl", "data.overlong_prompts=skip"),
             f"all 8 records are longer than {DEFAULT_BOUND} and data.overlong_prompts = skip left none",
             "set data.overlong_prompts to truncate_left", id="prompts-all-skipped"),
    data_row("train", quick("data.test_prompts={ws}/long.jsonl"), "data.test_prompts: ", "long.jsonl:1: the prompt",
             id="test-prompt-long"),
    data_row("train", quick("data.train_prompts={ws}/garbage.parquet"), "data.train_prompts: ",
             "garbage.parquet: not a readable Parquet file", "or convert it to .jsonl", id="prompts-parquet-garbage"),
    data_row("train", quick("data.train_prompts={ws}/prompts.csv"), "data.train_prompts: ",
             "prompts.csv' has the suffix '.csv'; use .jsonl", "or .parquet", id="prompts-suffix-csv"),
    data_row("train", quick("data.answer_key=reward_model.ground_truth"), "data.train_prompts: ",
             "train.jsonl:1: missing field 'reward_model.ground_truth'",
             "an answer at data.answer_key = 'reward_model.ground_truth'", id="answer-key-nested-missing"),
    data_row("train", quick("data.train_prompts={ws}/messages.jsonl"),
             "messages.jsonl:1: field 'prompt' is a list of chat messages, which only data.chat_template: true renders",
             id="messages-without-chat-template"),
    data_row("train", quick("data.chat_template=true"), "data.chat_template = true but data.tokenizer",
             "has no chat template", "or set data.chat_template: false", id="chat-template-missing"),
    data_row("train", quick("data.tokenizer={ws}/hf_tokenizer", "model.vocab_size=256"),
             "hf_tokenizer has 400 pieces but model.vocab_size = 256", id="vocab-below-hf-tokenizer"),
    data_row("train", quick("data.tokenizer={ws}/nope.model"), "data.tokenizer: tokenizer model",
             "nope.model' does not exist", id="tokenizer-missing"),
    data_row("train", quick("data.tokenizer={ws}/garbage.model"), "data.tokenizer: tokenizer model",
             "is not a valid sentencepiece model", id="tokenizer-garbage"),
    data_row("train", quick("model.vocab_size=256"), "pieces but model.vocab_size = 256", id="vocab-below-tokenizer"),
    data_row("sft", quick("data.sft_pairs={ws}/long.jsonl"), "data.sft_pairs: ",
             "long.jsonl:1: the pair ([BOS] + prompt + answer + EOS) is",
             "more than model.max_position_embeddings = 4096", id="sft-pair-beyond-context"),
    data_row("sft", quick("data.sft_pairs=''"), "data.sft_pairs is not set", id="sft-pairs-unset"),
    # -- catalog 3 (#56): packing and token budgets ------------------------------------------------
    config_row("train", quick("train.max_tokens_per_micro_batch=5"),
               "train.max_tokens_per_micro_batch = 5 is less than the longest sequence, 4096 tokens",
               "raise it to 4096 or more", id="budget-below-one-prompt"),
    config_row("train", quick("data.max_prompt_tokens=20", "train.max_tokens_per_micro_batch=25"),
               "train.max_tokens_per_micro_batch = 25 is less than the longest sequence, 26 tokens",
               id="budget-one-token-short"),
    config_row("train", quick("train.max_tokens_per_micro_batch=-1"),
               "train.max_tokens_per_micro_batch = -1: it must be >= 0", id="budget-negative"),
    config_row("train", quick("train.pack_sequences=false", "train.max_tokens_per_micro_batch=64"),
               "train.max_tokens_per_micro_batch = 64 is a budget of packed micro-batches but train.pack_sequences "
               "is false", id="budget-unpacked"),
    data_row("sft", quick("train.max_tokens_per_micro_batch=5"),
             "train.max_tokens_per_micro_batch = 5 is less than the longest sequence, 10 tokens (the longest pair of "
             "data.sft_pairs", id="sft-budget-below-a-pair"),
    config_row("train", quick("train.micro_batch_size=0"), "train.micro_batch_size = 0: it must be >= 1",
               id="micro-batch-zero"),
    # -- catalog 3 (#56): context parallelism ------------------------------------------------------
    config_row("train", quick("parallel.context_parallel_size=3"),
               "world size 2 is not divisible by tensor_model_parallel_size * pipeline_model_parallel_size * "
               "context_parallel_size = 1 * 1 * 3 = 3", id="cp-3-of-2"),
    config_row("train", quick("parallel.context_parallel_size=0"), "parallel.context_parallel_size = 0: it must be "
               "at least 1", id="cp-zero"),
    config_row("train", quick("parallel.context_parallel_size=two"),
               "config.parallel.context_parallel_size: expected int, got 'two'", id="cp-text"),
    config_row("train", quick(*CP2, "parallel.tensor_model_parallel_size=2"), "= 2 * 1 * 2 = 4",
               "launch a multiple of 4 processes", id="cp2-tp2-of-2"),
    config_row("train", quick(*CP2, "parallel.pipeline_model_parallel_size=2"), "= 1 * 2 * 2 = 4",
               id="cp2-pp2-of-2"),
    config_row("train", quick("parallel.context_parallel_size=2", "parallel.expert_tensor_parallel_size=2"),
               "expert_tensor_parallel_size * expert_model_parallel_size * pipeline_model_parallel_size = "
               "2 * 2 * 1 = 4",
               id="cp2-ep2-etp2-of-2"),
    config_row("train", quick(*CP2, "parallel.sequence_parallel=true"),
               "parallel.sequence_parallel = true needs tensor_model_parallel_size > 1", id="cp2-sp-without-tp"),
    config_row("train", quick(*CP2, "parallel.context_parallel_comm=ring"),
               "parallel.context_parallel_comm = 'ring': use one of all_gather, p2p", id="cp-comm-unknown"),
    config_row("train", quick(*CP2, "logging.metric_hooks.probe_token.token=1"),
               "parallel.context_parallel_size = 2 with logging.metric_hooks", "remove the hooks", id="cp2-hooks"),
    config_row("sft", quick(*CP2, "logging.metric_hooks.probe_token.token=1"),
               "parallel.context_parallel_size = 2 with logging.metric_hooks", id="cp2-sft-hooks"),
    config_row("train", quick(*CP2, "placement.rollout_ranks=1"),
               "parallel.context_parallel_size = 2 with placement.rollout_ranks = 1",
               "set placement.rollout_ranks = 0", id="cp2-rollout-ranks"),
    config_row("train", quick(*CP2, "placement.rollout_ranks=1", "rollout.max_staleness=1"),
               "parallel.context_parallel_size = 2 with placement.rollout_ranks = 1", id="cp2-async-rollouts"),
    config_row("train", quick(*CP2, "rollout.prompts_per_step=3"),
               "rollout.prompts_per_step = 3", "parallel.context_parallel_size = 2 ranks cannot share evenly",
               "use a multiple of 2", id="cp2-prompts-odd"),
    # -- LoRA ----------------------------------------------------------------------------------------------
    config_row("train", quick("lora.rank=4", "lora.targets=[router]"), "lora.targets = ['router']: ['router']",
               "the router, the norms, the embedding and the LM head take no adapters", id="lora-target-unknown"),
    config_row("train", quick("lora.rank=4", "lora.targets=[q_proj]", "model.layer_pattern=L"),
               "lora.targets = ['q_proj']: ['q_proj'] name no layer of this minimax-m1 model",
               "(its linears: linear_fc1, linear_fc2, qkv_proj, output_gate, out_proj); remove them",
               id="lora-target-absent"),
    config_row("train", quick("lora.rank=64"), "lora.rank = 64: qkv_proj is [192, 64]",
               "use lora.rank < 64", id="lora-rank-too-large"),
    config_row("train", quick("lora.rank=4", "lora.dropout=1.5"), "lora.dropout = 1.5: use a probability in [0, 1)",
               id="lora-dropout"),
    config_row("train", quick("lora.rank=4", "train.load=''"),
               "lora.rank = 4 trains adapters on a frozen base, but train.load is unset", id="lora-without-base"),
    config_row("train", quick("lora.rank=4", "precision.params_dtype=bfloat16", "precision.fp8=tensorwise"),
               "lora.rank = 4 with precision.fp8 = tensorwise", "adapters sit on Megatron's local linears",
               "set precision.fp8=null", id="lora-fp8"),
    config_row("sft", quick("lora.rank=4"), "lora.rank = 4: megacispo.sft trains every weight", "set lora.rank=0",
               id="lora-sft"),
]


def _refuse_to_build(*args, **kwargs):
    raise AssertionError("the bad input got past the pre-flight checks: a model was about to be built")


@pytest.fixture
def rank_zero_of_two(catalog_workspace, monkeypatch):
    """This process as rank 0 of a world of 2, the workspace's reward modules importable, and no model
    ever built."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.syspath_prepend(str(catalog_workspace))
    monkeypatch.setattr(layout, "init_distributed", _refuse_to_build)


@pytest.mark.parametrize("entry, argv, fragments", CATALOG)
def test_bad_input_gets_one_error_line_and_exit_code_2(entry, argv, fragments, catalog_workspace, rank_zero_of_two,
                                                       tmp_path, capsys):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        ENTRY_POINTS[entry].main(run_argv(argv, catalog_workspace, run_dir))
    captured = capsys.readouterr()
    assert exit_info.value.code == 2, captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    missing = [fragment for fragment in fragments if fragment not in lines[0]]
    assert not missing, f"{missing} not in {lines[0]!r}"
    assert "Traceback" not in captured.out + captured.err
    assert not run_dir.exists()


def test_other_ranks_exit_quietly_with_the_same_code(catalog_workspace, rank_zero_of_two, monkeypatch, tmp_path,
                                                     capsys):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as exit_info:
        train.main(run_argv(quick("optimizer.lr=-1"), catalog_workspace, tmp_path / "run"))
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("row_id", ["lr-negative", "prompt-5000-tokens"])
def test_two_processes_print_the_error_once(row_id, catalog_workspace, tmp_path):
    [row] = [row for row in CATALOG if row.id == row_id]
    _, argv, fragments = row.values
    run_dir = tmp_path / "run"
    result = torchrun(run_argv(argv, catalog_workspace, run_dir), catalog_workspace, timeout=120)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and all(fragment in errors[0] for fragment in fragments), output[-3000:]
    # torchrun reports the exit code of the first worker to end (and prints a traceback of its own launcher).
    assert result.returncode != 0 and re.search(r"exitcode\s*: 2 \(pid", output), output[-3000:]
    assert "megacispo/" not in "".join(line for line in output.splitlines() if line.lstrip().startswith('File "'))
    assert not run_dir.exists()
