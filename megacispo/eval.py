"""Evaluation entry point:

    torchrun --nproc-per-node N -m megacispo.eval --config X.yaml --load CKPT [--set k=v ...]

Evaluates data.test_prompts as the eval section asks (megacispo.evaluation: greedy accuracy, pass@k
and mean@k over eval.num_samples responses per prompt, scored by rl.reward) under the config's
parallel layout. --load is a megacispo checkpoint (a step_* directory, or a checkpoints root: its
newest) or a Hugging Face directory. The logging rank prints a table of the metrics and writes them to
TensorBoard under <train.run_dir>/eval/tensorboard, at the checkpoint's step (0 for a Hugging Face
directory).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from megacispo.checkpoint import CheckpointError, load_checkpoint, params_dtype_of, read_meta, resolve_checkpoint
from megacispo.cli import bad_input_exits, build_parser, load_rl_prompt_file, load_tokenizer, plan, start_up
from megacispo.config import Config
from megacispo.hf_checkpoint import check_start_weights, hf_params_dtype_name, is_hf_directory, load_hf_weights
from megacispo.metrics import MetricsLogger, is_logging_rank
from megacispo.parallel.layout import destroy_distributed, init_distributed
from megacispo.rewards import get_reward_fn

EVAL_DIR = "eval"


@dataclass(frozen=True)
class WeightsSource:
    """The weights --load names, found before anything is built."""

    path: Path
    """A verified megacispo step directory, or a Hugging Face directory."""
    is_hf: bool
    """``path`` is a Hugging Face directory."""
    params_dtype: str
    """The dtype name the weights are stored in: float32 | bfloat16."""
    step: int
    """The step the metrics are logged at: the checkpoint's, 0 for a Hugging Face directory."""


def check_eval(config: Config, data_parallel_size: int) -> None:
    """What an evaluation needs of the config (any data-parallel size splits the test prompts)."""
    if not config.data.test_prompts:
        raise ValueError("data.test_prompts is not set: megacispo.eval evaluates it; give its path in the config or "
                         "with --set data.test_prompts=PATH")
    if not config.eval.greedy and not config.eval.num_samples:
        raise ValueError("eval.greedy = false and eval.num_samples = 0: nothing to evaluate; set eval.greedy=true "
                         "or eval.num_samples=K")
    if not config.train.load:
        raise ValueError("train.load is not set: pass --load CKPT, a megacispo checkpoint or a Hugging Face directory")


def weights_source(config: Config) -> WeightsSource:
    """The weights of train.load, checked against config.model as the trainer checks its start weights
    (CheckpointError naming the file and the fix) before any model is built."""
    load = Path(config.train.load)
    check_start_weights("train.load", load, config.model)
    if is_hf_directory(load):
        return WeightsSource(load, True, hf_params_dtype_name(load), 0)
    step_dir = resolve_checkpoint(load)
    meta = read_meta(step_dir)
    return WeightsSource(step_dir, False, params_dtype_of(meta), meta["step"])


def eval_plan(config: Config, source: WeightsSource) -> str:
    """One line on what the evaluation computes, and where its metrics go."""
    # evaluation imports Megatron-Core (the rollout engine): here, so that --help and bad input do not.
    from megacispo.evaluation import pass_at_k_values

    evaluation = config.eval
    parts = ["greedy accuracy"] if evaluation.greedy else []
    if evaluation.num_samples:
        ks = ", ".join(str(k) for k in pass_at_k_values(evaluation.num_samples))
        parts.append(f"pass@k (k = {ks}) and mean@{evaluation.num_samples} over {evaluation.num_samples} samples per "
                     f"prompt at temperature {evaluation.temperature}, top_p {evaluation.top_p}")
    kind = "Hugging Face directory" if source.is_hf else f"checkpoint of step {source.step}"
    return (f"evaluation: {' and '.join(parts)} on {config.data.test_prompts}, rewarded by {config.rl.reward}; "
            f"weights: {kind} {source.path} ({source.params_dtype}); metrics to {eval_log_dir(config)}")


def eval_log_dir(config: Config) -> Path:
    """Where the metrics' TensorBoard events go (a MetricsLogger's run_dir: events in its tensorboard/)."""
    return Path(config.train.run_dir) / EVAL_DIR


def format_table(metrics: dict[str, float]) -> str:
    """The metrics as two aligned columns, metric and value."""
    width = max(len("metric"), *(len(key) for key in metrics))
    rows = [f"{'metric':<{width}}  value"] + [f"{key:<{width}}  {value:.4f}" for key, value in metrics.items()]
    return "\n".join(rows)


def load_model(config: Config, source: WeightsSource):
    """This rank's piece of the model with the weights of ``source`` (after init_distributed)."""
    # Megatron-Core: imported once the process group exists; the dry run imports none of it.
    from megacispo.engine import build_inference_model

    model = build_inference_model(config.model, source.params_dtype, config.parallel)
    if source.is_hf:
        load_hf_weights(model, source.path)
    else:
        load_checkpoint(source.path, model, load_rng=False)
    return model


def evaluate(config: Config, model, tokenizer, records) -> dict[str, float]:
    """The metrics of megacispo.evaluation on every rank, rewarded by rl.reward."""
    # Megatron-Core: imported once the process group exists; the dry run imports none of it.
    from megatron.core import parallel_state

    from megacispo.evaluation import Evaluator

    return Evaluator(model, tokenizer, records, get_reward_fn(config.rl.reward), config,
                     parallel_state.get_data_parallel_group()).run()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(__doc__, load_field="train.load")
    args = parser.parse_args(argv)
    with bad_input_exits():
        config, world_size = start_up(args, check_eval)
        source = weights_source(config)
        if args.dry_run:
            print(plan(config, world_size))
            print(eval_plan(config, source))
            return 0
        tokenizer = load_tokenizer(config)
        records, _ = load_rl_prompt_file(config, tokenizer, "test_prompts")

    init_distributed(config.parallel, config.train.seed)
    with bad_input_exits(CheckpointError):  # raised on every rank alike
        model = load_model(config, source)
    metrics = evaluate(config, model, tokenizer, records)
    if is_logging_rank():
        print(format_table(metrics), flush=True)
    with MetricsLogger(eval_log_dir(config), enabled=is_logging_rank(), console=False) as logger:
        logger.log(source.step, metrics)
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
