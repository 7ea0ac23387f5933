"""Score token sequences with a checkpoint: per-token log-probabilities of the model.

    torchrun --nproc-per-node N -m megacispo.score --load CKPT --tokens in.jsonl --out out.jsonl \
        [--config X.yaml] [--set parallel.expert_model_parallel_size=E ...] [--dry-run]

Each input line is a JSON object with "tokens": [ids]; the output line is the same object plus
"logprobs", where logprobs[i] = log p(tokens[i + 1] | tokens[: i + 1]) (length len(tokens) - 1),
computed in fp32 from the model's vocab-sharded logits with vocab_parallel_logprobs over the TP
group. Input and output are strict JSON (no NaN or Infinity): a log-prob that is not finite (an
overflow in the forward pass) is written as null, its positions listed under
"nonfinite_positions", and a warning says how many sequences have one. --load is a megacispo
checkpoint (a step_* directory, or a checkpoints root: its newest step) or a Hugging Face directory,
checked before any process group exists; the model and its dtype are the checkpoint's (an HF
directory's config.json: a model section of --config that contradicts it is an error), and every
rank reads its own piece of the weights, each tensor checked to be finite (a NaN or infinity ends
the run with one error naming the tensor and its file). The layout is the config's parallel section
(--config and --set, as for megacispo.train): parallel.*_size splits the model as in training, and
with TP > 1 the model runs with sequence parallelism, as megacispo trains it (each sequence is
padded at its end to a multiple of TP: causal, so earlier positions do not see the padding; the MoE
drops no tokens). With parallel.context_parallel_size = CP > 1 each sequence is split over the CP
ranks as training splits a packed row (padded at its end to a multiple of 2 x CP, each rank holding
two zigzag chunks; parallel.context_parallel_comm picks the softmax layers' scheme), so that a
sequence longer than one GPU holds is scored with its training layout. The sequences are split
over the data-parallel ranks, one sequence per forward through Megatron's schedule; rank 0 writes
--out atomically.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from megacispo.checkpoint.distributed import (
    CheckpointError,
    params_dtype_of,
    read_meta,
    resolve_checkpoint,
)
from megacispo.checkpoint.formats import is_hf_directory
from megacispo.checkpoint.hf import hf_params_dtype_name
from megacispo.checkpoint.hf_reader import check_hf_checkpoint
from megacispo.config import Config
from megacispo.models.config import HybridModelConfig, model_shape
from megacispo.parallel.layout import (
    ParallelConfig,
    destroy_model_parallel,
    init_distributed,
    validate_layout,
    world_size_from_env,
)
from megacispo.startup import bad_input_exits, build_parser, load_run_config


def score_parser() -> argparse.ArgumentParser:
    """The entry points' command line (--config, --set, --load, --dry-run) with --tokens and --out."""
    parser = build_parser(__doc__, load_field="train.load")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--tokens", required=True, help='input JSONL, one {"tokens": [ids]} per line')
    parser.add_argument("--out", required=True, help="output JSONL (each input object plus logprobs)")
    return parser


def _refuse_constant(name: str) -> None:
    """Python's json reads NaN and Infinity, which JSON lacks: --out must be strict JSON."""
    raise json.JSONDecodeError(f"{name} is not JSON", name, 0)


def read_records(path: str | os.PathLike, model: HybridModelConfig) -> list[dict[str, Any]]:
    """The input objects; ValueError naming the line for anything that is not a non-empty list of
    token ids in [0, model.vocab_size), at most model.max_position_embeddings long."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--tokens {path}: no such file.")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line, parse_constant=_refuse_constant)
        except json.JSONDecodeError as error:
            raise ValueError(f"--tokens {path} line {number}: not JSON ({error}).") from None
        tokens = record.get("tokens") if isinstance(record, dict) else None
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) and not isinstance(t, bool)
                                                                   for t in tokens):
            raise ValueError(f'--tokens {path} line {number}: expected {{"tokens": [ids]}} with at least one int id.')
        bad = [t for t in tokens if not 0 <= t < model.vocab_size]
        if bad:
            raise ValueError(f"--tokens {path} line {number}: token id {bad[0]} is outside the model's vocabulary "
                             f"[0, {model.vocab_size}).")
        if len(tokens) > model.max_position_embeddings:
            # Past its context the model was never trained: its log-probs there would mean nothing.
            raise ValueError(f"--tokens {path} line {number}: {len(tokens)} tokens, more than the model's context, "
                             f"model.max_position_embeddings = {model.max_position_embeddings}; split or shorten it.")
        records.append(record)
    if not records:
        raise ValueError(f"--tokens {path}: no sequences in it.")
    return records


def model_config_of(load: str | os.PathLike, config: Config) -> tuple[HybridModelConfig, str]:
    """(HybridModelConfig, params dtype name) of --load, read before any process group exists. An HF
    directory's model is the config's (load_config took it from its config.json), and its tensors are
    checked against it here; a megacispo checkpoint's is the one its meta.json records."""
    load = Path(load)
    if is_hf_directory(load):
        try:
            check_hf_checkpoint(load, config.model)
            return config.model, hf_params_dtype_name(load)
        except ValueError as error:
            raise ValueError(f"--load: {error}") from None
    try:
        step_dir = resolve_checkpoint(load)
    except CheckpointError as error:
        raise CheckpointError(f"--load: {error}") from None
    meta = read_meta(step_dir)
    if not meta.get("config") or "model" not in meta["config"]:
        raise ValueError(f"--load {step_dir}: its meta.json has no config.model.")
    return HybridModelConfig(**meta["config"]["model"]), params_dtype_of(meta)


def scoring_layout(parallel: ParallelConfig, model: HybridModelConfig, world_size: int) -> ParallelConfig:
    """The config's layout with sequence parallelism on exactly when TP > 1 (the MoE needs it under TP,
    as in training), checked against the scored model."""
    parallel = dataclasses.replace(parallel, sequence_parallel=parallel.tensor_model_parallel_size > 1)
    validate_layout(parallel, world_size, model_shape(model))
    return parallel


def score_plan(load: str, model: HybridModelConfig, params_dtype: str, parallel: ParallelConfig, world_size: int,
               num_records: int) -> str:
    """What a scoring run would do, for --dry-run."""
    return (f"score: {num_records} sequences with the {model.num_layers}-layer model of {load} ({params_dtype}); "
            f"layout: world {world_size} = TP {parallel.tensor_model_parallel_size} x PP "
            f"{parallel.pipeline_model_parallel_size} x CP {parallel.context_parallel_size} x DP "
            f"{parallel.data_parallel_size(world_size)}, EP "
            f"{parallel.expert_model_parallel_size}, expert TP {parallel.expert_tp}, sequence parallel "
            f"{parallel.sequence_parallel}")


def run(argv: list[str] | None = None) -> None:
    """Parse, validate before any work, score; leaves torch.distributed initialized (the model-parallel
    state is torn down), so that one process can score several times (tests)."""
    parser = score_parser()
    args = parser.parse_args(argv)
    if not args.load:
        parser.error("--load is required: a megacispo checkpoint or a Hugging Face directory")
    with bad_input_exits():
        config, world_size = load_run_config(args), world_size_from_env()
        model, params_dtype = model_config_of(args.load, config)
        parallel = scoring_layout(config.parallel, model, world_size)
        records = read_records(args.tokens, model)
        if args.dry_run:
            print(score_plan(args.load, model, params_dtype, parallel, world_size, len(records)))
            return
    # After the dry run, which imports no Megatron-Core: scoring does.
    from megacispo.evaluation.scoring import score

    init_distributed(parallel, seed=0, fp32_matmul=config.precision.fp32_matmul)
    try:
        with bad_input_exits(CheckpointError):  # raised on every rank alike
            score(args.load, args.out, model, parallel, records, params_dtype)
    finally:
        destroy_model_parallel()


def main(argv: list[str] | None = None) -> int:
    run(argv)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
