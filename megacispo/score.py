"""Score token sequences with a checkpoint: per-token log-probabilities of the model.

    torchrun --nproc-per-node N -m megacispo.score --load CKPT --tokens in.jsonl --out out.jsonl \
        [--tp T --pp P --ep E --etp X]

Each input line is a JSON object with "tokens": [ids]; the output line is the same object plus
"logprobs", where logprobs[i] = log p(tokens[i + 1] | tokens[: i + 1]) (length len(tokens) - 1),
computed in fp32 from the model's vocab-sharded logits with vocab_parallel_logprobs over the TP
group. --load is a megacispo checkpoint (a step_* directory, or a checkpoints root: its newest
step) or a Hugging Face directory, checked against its config.json before any process group
exists, of whose tensors every rank reads its own piece (megacispo.hf_checkpoint.load_hf_weights,
in the dtype they are stored in). The sequences are split over the data-parallel ranks, one
sequence per forward; rank 0 writes --out atomically. The forward runs through Megatron's schedule, so --pp > 1 splits the layers into
stages; --ep spreads the experts over ranks and --etp splits each expert (default: --tp; --etp 1
keeps experts whole, so that --tp 2 --ep 2 --etp 1 runs on 2 processes). With TP > 1 the model
runs with sequence parallelism, as megacispo trains it: each sequence is padded at its end to a
multiple of TP (causal, so earlier positions do not see the padding; the MoE drops no tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from megacispo.data import atomic_write_text
from megacispo.hf_checkpoint import (
    check_hf_checkpoint,
    hf_model_config,
    hf_params_dtype_name,
    is_hf_directory,
    load_hf_weights,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="megacispo checkpoint (step dir or root) or HF directory")
    parser.add_argument("--tokens", required=True, help='input JSONL, one {"tokens": [ids]} per line')
    parser.add_argument("--out", required=True, help="output JSONL (each input object plus logprobs)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size")
    parser.add_argument("--etp", type=int, default=None,
                        help="expert tensor-parallel size (default: --tp; 1 keeps every expert whole)")
    return parser


def read_records(path: str | os.PathLike, vocab_size: int) -> list[dict[str, Any]]:
    """The input objects; ValueError naming the line for anything that is not a non-empty list of
    token ids in [0, vocab_size)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--tokens {path}: no such file.")
    records = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"--tokens {path} line {number}: not JSON ({error}).") from None
        tokens = record.get("tokens") if isinstance(record, dict) else None
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) and not isinstance(t, bool)
                                                                   for t in tokens):
            raise ValueError(f'--tokens {path} line {number}: expected {{"tokens": [ids]}} with at least one int id.')
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"--tokens {path} line {number}: token id {bad[0]} is outside the model's vocabulary [0, {vocab_size})."
            )
        records.append(record)
    if not records:
        raise ValueError(f"--tokens {path}: no sequences in it.")
    return records


def model_config_of(load: str | os.PathLike):
    """(HybridModelConfig, params dtype name) of --load, read before any process group exists; an HF
    directory's tensors are checked against its config.json here, before any model is built."""
    from megacispo.checkpoint import CheckpointError, params_dtype_of, read_meta, resolve_checkpoint
    from megacispo.models.config import HybridModelConfig

    load = Path(load)
    if is_hf_directory(load):
        try:
            config = hf_model_config(load)
            check_hf_checkpoint(load, config)
            return config, hf_params_dtype_name(load)
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


def parallel_config(args: argparse.Namespace, config, world_size: int):
    from megacispo.models.config import model_shape
    from megacispo.parallel.layout import ParallelConfig, validate_layout

    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp, expert_model_parallel_size=args.ep,
        expert_tensor_parallel_size=args.etp, sequence_parallel=args.tp > 1,
    )
    validate_layout(parallel, world_size, model_shape(config))
    return parallel


@torch.no_grad()
def _sequence_logprobs(model, tokens: list[int], tp_group) -> torch.Tensor | None:
    """[len(tokens) - 1] fp32 log-probs of each next token on the last pipeline stage (None on
    the others), through Megatron's schedule (forward only; 1F1B hands activations between stages)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megacispo.parallel.layout import run_device
    from megacispo.parallel.vocab_parallel import vocab_parallel_logprobs

    device = run_device()
    tp_size = torch.distributed.get_world_size(tp_group)
    padded = -(-len(tokens) // tp_size) * tp_size if model.config.sequence_parallel else len(tokens)
    input_ids = torch.zeros(1, padded, dtype=torch.long, device=device)
    input_ids[0, : len(tokens)] = torch.tensor(tokens, device=device)
    targets = input_ids[:, 1 : len(tokens)]

    def loss_func(logits: torch.Tensor):  # logits [1, padded, V/TP]
        logprobs = vocab_parallel_logprobs(logits[:, : len(tokens) - 1].float(), targets, tp_group=tp_group)
        return logits.new_zeros(()), {"logprobs": logprobs[0].cpu()}

    def forward_step(data_iterator, model_chunk):
        return model_chunk(next(data_iterator)), loss_func

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([input_ids]), model=[model], num_microbatches=1,
        seq_length=padded, micro_batch_size=1, forward_only=True,
    )
    return outputs[0]["logprobs"] if outputs else None


def score(load: str, out: str, config, parallel, records: list[dict], params_dtype: str) -> None:
    """Score every record and write --out on rank 0 (every rank calls it, after init_distributed)."""
    from megatron.core import parallel_state

    from megacispo.checkpoint import load_checkpoint, resolve_checkpoint
    from megacispo.engine import build_inference_model

    model = build_inference_model(config, params_dtype, parallel)
    if is_hf_directory(load):
        load_hf_weights(model, load)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # RNG states of another layout: not used here
            load_checkpoint(resolve_checkpoint(load), model, load_rng=False)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    mine = list(range(dp_rank, len(records), dp_size))
    rounds = -(-len(records) // dp_size)
    results = {}
    for position in range(rounds):
        # Every rank runs the same number of forwards: the MoE's all-to-all spans DP ranks under EP.
        index = mine[position] if position < len(mine) else None
        tokens = records[index if index is not None else 0]["tokens"]
        logprobs = _sequence_logprobs(model, tokens, tp_group)
        if index is not None and logprobs is not None:
            results[index] = logprobs.tolist()
    gathered = [None] * torch.distributed.get_world_size() if torch.distributed.get_rank() == 0 else None
    torch.distributed.gather_object(results, gathered, dst=0)
    if torch.distributed.get_rank() == 0:
        merged = {index: logprobs for part in gathered for index, logprobs in part.items()}
        assert len(merged) == len(records), "every record is scored by some rank"
        scored = ({**record, "logprobs": merged[i]} for i, record in enumerate(records))
        atomic_write_text(out, "".join(json.dumps(record) + "\n" for record in scored))
    torch.distributed.barrier()


def run(argv: list[str] | None = None) -> None:
    """Parse, validate before any work, score; leaves torch.distributed initialized (the model-parallel
    state is torn down), so that one process can score several times (tests)."""
    from megatron.core import parallel_state

    from megacispo.checkpoint import CheckpointError
    from megacispo.cli import bad_input_exits
    from megacispo.parallel.layout import init_distributed, world_size_from_env

    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    with bad_input_exits():
        config, params_dtype = model_config_of(args.load)
        parallel = parallel_config(args, config, world_size_from_env())
        records = read_records(args.tokens, config.vocab_size)
    init_distributed(parallel, seed=0)
    try:
        with bad_input_exits(CheckpointError):  # raised on every rank alike
            score(args.load, args.out, config, parallel, records, params_dtype)
    finally:
        parallel_state.destroy_model_parallel()


def main(argv: list[str] | None = None) -> int:
    run(argv)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
