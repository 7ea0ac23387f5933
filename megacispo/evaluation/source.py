"""What an evaluation reads and computes, known before anything is built: the weights --load names
(WeightsSource), the config's checks, and the plan of a dry run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megacispo.checkpoint.distributed import params_dtype_of, read_meta, resolve_checkpoint
from megacispo.checkpoint.formats import is_hf_directory
from megacispo.checkpoint.hf import check_start_weights, hf_params_dtype_name
from megacispo.config import Config
from megacispo.evaluation.pass_at_k import pass_at_k_values

# Under train.run_dir: where an evaluation's TensorBoard events go.
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
