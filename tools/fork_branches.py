"""Measure the fork of the worked-addition task on a checkpoint, before any RL.

    python tools/fork_branches.py --config X.yaml --load CKPT [--marker "~"] [--set k=v ...]

On data.test_prompts, greedily, in one process (TP = PP = 1), prints:
    worked branch accuracy   the response forced to start with the marker token (prompt + marker,
                             then greedy): how well the model does when it works the sum out
    direct branch accuracy   the marker banned at the response's first position (the most likely
                             other first token, then greedy): how well it answers directly
    marker probability       the mean over the prompts of the marker's probability at the
                             response's first position (teacher-forced on the prompt): how often
                             sampling would take the worked branch
Both branches are graded by rl.reward; the task's is ``numeric``, which reads the sum of either
branch (arithmetic_tasks). rollout.max_new_tokens must leave room for the worked steps (about 8
tokens per column). The marker is arithmetic_tasks.WORKED_MARKER unless --marker says otherwise; it
must be one token of data.tokenizer.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

import torch
from arithmetic_tasks import WORKED_MARKER

from megacispo.checkpoint.distributed import CheckpointError
from megacispo.config import Config
from megacispo.data.prompts import PromptRecord, prompt_token_ids
from megacispo.data.rewards import get_reward_fn, score_responses
from megacispo.data.tokenizer import Tokenizer
from megacispo.evaluation.evaluator import EVAL_STREAM
from megacispo.evaluation.run import load_model
from megacispo.evaluation.source import check_eval, weights_source
from megacispo.parallel.layout import destroy_distributed, init_distributed, run_device
from megacispo.rollout.episodes import response_text
from megacispo.rollout.generate import generate, sample_keys
from megacispo.startup import bad_input_exits, build_parser, load_rl_prompt_file, load_tokenizer, start_up


@dataclass(frozen=True)
class ForkMeasurement:
    """The fork's three numbers over the test prompts."""

    worked_accuracy: float
    direct_accuracy: float
    marker_probability: float


def marker_token(tokenizer: Tokenizer, marker: str) -> int:
    """The id of ``marker``, which must be one token (else the branches are not a fork)."""
    try:
        return tokenizer.single_token_id(marker)
    except ValueError as error:
        raise ValueError(
            f"--marker: {error}; train the tokenizer on a corpus holding the worked answers (make_task_data.py "
            "--sft-worked) or pass the marker it was trained with"
        ) from None


def check_single_process(config: Config, world_size: int) -> None:
    """The tool runs the whole model in one process: no tensor or pipeline split."""
    if world_size != 1:
        raise ValueError(f"world size {world_size}: run tools/fork_branches.py as one plain python process")
    sizes = (config.parallel.tensor_model_parallel_size, config.parallel.pipeline_model_parallel_size)
    if sizes != (1, 1):
        raise ValueError(f"parallel TP, PP = {sizes}: set parallel.tensor_model_parallel_size=1 and "
                         "parallel.pipeline_model_parallel_size=1 (one process holds the whole model)")


@torch.no_grad()
def first_token_probabilities(model, prompts: list[list[int]]) -> torch.Tensor:
    """[len(prompts), V] fp32 next-token distribution after each prompt, one prompt per forward (no padding
    reaches the MoE routers)."""
    device = run_device()
    rows = [model(torch.tensor([prompt], dtype=torch.long, device=device))[0, -1].float() for prompt in prompts]
    return torch.stack(rows).softmax(dim=-1)


def _greedy_accuracy(model, tokenizer: Tokenizer, config: Config, records: list[PromptRecord],
                     prompts: list[list[int]], forced: list[int]) -> float:
    """Greedy accuracy with the response's first token forced to ``forced[i]`` for prompt i (a stop token
    there ends the response empty)."""
    greedy = dataclasses.replace(config.rollout, temperature=0.0, top_k=0, early_truncation_tokens=0)
    keys = sample_keys((config.train.seed, EVAL_STREAM), range(len(prompts)), 1, device=run_device())
    samples = generate(model, [prompt + [first] for prompt, first in zip(prompts, forced)], greedy,
                       stop_ids=tokenizer.stop_ids, pad_id=tokenizer.pad_id, keys=keys)
    texts = [
        "" if first in tokenizer.stop_ids else tokenizer.decode([first]) + response_text(tokenizer, samples, row)
        for row, first in enumerate(forced)
    ]
    rewards = score_responses(get_reward_fn(config.rl.reward), texts, records, config.rl.failure_reward,
                              timeout_s=config.rl.reward_timeout_s).rewards
    return sum(reward >= 1.0 for reward in rewards) / len(records)


def measure_fork(model, tokenizer: Tokenizer, config: Config, records: list[PromptRecord],
                 marker_id: int) -> ForkMeasurement:
    """Both forced branches' greedy accuracy and the marker's mean first-position probability."""
    prompts = [prompt_token_ids(tokenizer, record) for record in records]
    probabilities = first_token_probabilities(model, prompts)
    banned = probabilities.clone()
    banned[:, marker_id] = -1.0
    direct_first = banned.argmax(dim=-1).tolist()
    return ForkMeasurement(
        worked_accuracy=_greedy_accuracy(model, tokenizer, config, records, prompts, [marker_id] * len(prompts)),
        direct_accuracy=_greedy_accuracy(model, tokenizer, config, records, prompts, direct_first),
        marker_probability=probabilities[:, marker_id].mean().item(),
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(__doc__, load_field="train.load")
    parser.add_argument("--marker", default=WORKED_MARKER, help="the token that starts the worked branch")
    args = parser.parse_args(argv)
    with bad_input_exits():
        config, world_size = start_up(args, check_eval)
        check_single_process(config, world_size)
        source = weights_source(config)
        tokenizer = load_tokenizer(config)
        marker_id = marker_token(tokenizer, args.marker)
        records, _ = load_rl_prompt_file(config, tokenizer, "test_prompts")
    init_distributed(config.parallel, config.train.seed, config.precision.fp32_matmul)
    with bad_input_exits(CheckpointError):
        model = load_model(config, source)
    measurement = measure_fork(model, tokenizer, config, records, marker_id)
    print(f"{len(records)} test prompts, greedy, graded by {config.rl.reward}; marker {args.marker!r} (id {marker_id})")
    print(f"worked branch accuracy: {measurement.worked_accuracy:.4f}")
    print(f"direct branch accuracy: {measurement.direct_accuracy:.4f}")
    print(f"marker probability at the response's start: {measurement.marker_probability:.4f}")
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
