"""An evaluation run of a checkpoint, behind the entry point megacispo.eval: the model built with
its weights, evaluated on every rank, the metrics printed and logged."""

from __future__ import annotations

import functools

from megatron.core import parallel_state

from megacispo.checkpoint.distributed import CheckpointError, load_checkpoint
from megacispo.checkpoint.hf import load_hf_weights
from megacispo.config import Config
from megacispo.data.prompts import PromptRecord
from megacispo.data.tokenizer import Tokenizer
from megacispo.evaluation.evaluator import Evaluator
from megacispo.evaluation.source import WeightsSource, eval_log_dir
from megacispo.metrics.logger import MetricsLogger, is_logging_rank
from megacispo.parallel.layout import destroy_distributed, init_distributed
from megacispo.rollout.episodes import Environments, Scoring
from megacispo.rollout.generate import generate
from megacispo.startup import bad_input_exits
from megacispo.training.engine import build_inference_model


def format_table(metrics: dict[str, float]) -> str:
    """The metrics as two aligned columns, metric and value."""
    width = max(len("metric"), *(len(key) for key in metrics))
    rows = [f"{'metric':<{width}}  value"] + [f"{key:<{width}}  {value:.4f}" for key, value in metrics.items()]
    return "\n".join(rows)


def load_model(config: Config, source: WeightsSource):
    """This rank's piece of the model with the weights of ``source`` (after init_distributed)."""
    model = build_inference_model(config.model, source.params_dtype, config.parallel)
    if source.is_hf:
        load_hf_weights(model, source.path)
    else:
        load_checkpoint(source.path, model, load_rng=False)
    return model


def evaluate(config: Config, model, tokenizer, records) -> dict[str, float]:
    """The metrics of megacispo.evaluation.evaluator on every rank, rewarded by rl.reward (and env.name's
    environment, as a run's rollouts are)."""
    scoring = Scoring.from_config(config.rl)
    # Over DP x CP: decoding never splits a sequence, so each CP rank takes test prompts of its own.
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return Evaluator(functools.partial(generate, model), tokenizer, records, dp_cp, settings=config.eval,
                     rollout=config.rollout, seed=config.train.seed, scoring=scoring,
                     environments=Environments.build(config.env, tokenizer, config.data.chat_template,
                                                     config.max_prompt_tokens)).run()


def run_eval(config: Config, source: WeightsSource, tokenizer: Tokenizer, records: list[PromptRecord]) -> None:
    """Evaluate ``source``'s weights on ``records`` under the config's layout."""
    init_distributed(config.parallel, config.train.seed, config.precision.fp32_matmul)
    with bad_input_exits(CheckpointError):  # raised on every rank alike
        model = load_model(config, source)
    metrics = evaluate(config, model, tokenizer, records)
    if is_logging_rank():
        print(format_table(metrics), flush=True)
    with MetricsLogger(eval_log_dir(config), enabled=is_logging_rank(), console=False) as logger:
        logger.log(source.step, metrics)
    destroy_distributed()
