"""Per-token log-probabilities of token sequences under a checkpoint, behind the entry point
megacispo.score: the model built with its weights (checked to be finite as they are read), each
sequence through Megatron's schedule (forward only) as a packed row of its own, split over the
context-parallel ranks as training splits it, the records split over the data-parallel ranks and
written by rank 0 as strict JSON (``scored_line``)."""

from __future__ import annotations

import json
import math
import warnings

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megacispo.checkpoint.distributed import load_checkpoint, resolve_checkpoint
from megacispo.checkpoint.formats import is_hf_directory
from megacispo.checkpoint.hf import load_hf_weights
from megacispo.files import atomic_write_text
from megacispo.models.config import HybridModelConfig
from megacispo.parallel.layout import ParallelConfig, run_device
from megacispo.parallel.vocab_parallel import vocab_parallel_logprobs
from megacispo.training.engine import build_inference_model
from megacispo.training.packing import pack_rows, row_length_multiple


@torch.no_grad()
def _sequence_logprobs(model, tokens: list[int], parallel: ParallelConfig) -> torch.Tensor | None:
    """[len(tokens) - 1] fp32 log-probs of each next token on the last pipeline stage (None on
    the others), through Megatron's schedule (forward only; 1F1B hands activations between stages).
    The sequence is a packed row of its own, as training packs it (megacispo.training.packing): padded
    at its end to what the layout splits a row by, and under context parallelism each CP rank runs its
    zigzag share and the ranks sum the log-probs each wrote at its own positions."""
    device = run_device()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    cp_group = parallel_state.get_context_parallel_group()
    length = len(tokens)
    (row,) = pack_rows([length], length, length, 1, row_length_multiple(parallel, fp8=False), device,
                       cp_size=cp_group.size(), cp_rank=cp_group.rank())
    sequence = torch.tensor([tokens], device=device)
    targets = row.pack(sequence[:, 1:])

    def loss_func(logits: torch.Tensor):  # logits [1, w, V/TP] at this CP rank's positions of the row
        logprobs = logits.new_zeros(1, length - 1, dtype=torch.float32)
        row.unpack(vocab_parallel_logprobs(logits.float(), targets, tp_group=tp_group), logprobs)
        if cp_group.size() > 1:
            torch.distributed.all_reduce(logprobs, group=cp_group)
        return logits.new_zeros(()), {"logprobs": logprobs[0].cpu()}

    def forward_step(data_iterator, model_chunk):
        return model_chunk(next(data_iterator), packed_seq_params=row.packed_seq_params), loss_func

    # The schedule takes the row's whole width and divides it over the CP ranks.
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([row.pack(sequence)]), model=[model], num_microbatches=1,
        seq_length=row.width, micro_batch_size=1, forward_only=True,
    )
    return outputs[0]["logprobs"] if outputs else None


# The key that lists a record's non-finite log-probs (null in its "logprobs").
NONFINITE_KEY = "nonfinite_positions"


def scored_line(record: dict, logprobs: list[float]) -> str:
    """``record`` with its "logprobs" as one line of strict JSON (no NaN or Infinity, which JSON lacks).
    A log-prob that is not finite (an overflow in the forward pass: the weights were checked to be
    finite) is written as null, and the positions of those are listed under NONFINITE_KEY."""
    nonfinite = [position for position, value in enumerate(logprobs) if not math.isfinite(value)]
    scored = {**record, "logprobs": [value if math.isfinite(value) else None for value in logprobs]}
    if nonfinite:
        scored[NONFINITE_KEY] = nonfinite
    return json.dumps(scored, allow_nan=False) + "\n"


def score(load: str, out: str, config: HybridModelConfig, parallel: ParallelConfig, records: list[dict],
          params_dtype: str) -> None:
    """Score every record and write --out on rank 0 (every rank calls it, after init_distributed)."""
    model = build_inference_model(config, params_dtype, parallel)
    if is_hf_directory(load):
        load_hf_weights(model, load)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # RNG states of another layout: not used here
            load_checkpoint(resolve_checkpoint(load), model, load_rng=False)
    # The CP ranks of a replica score the same sequences, each its share of every row.
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    mine = list(range(dp_rank, len(records), dp_size))
    rounds = -(-len(records) // dp_size)
    results = {}
    for position in range(rounds):
        # Every rank runs the same number of forwards: the MoE's all-to-all spans DP ranks under EP.
        index = mine[position] if position < len(mine) else None
        tokens = records[index if index is not None else 0]["tokens"]
        logprobs = _sequence_logprobs(model, tokens, parallel)
        if index is not None and logprobs is not None:
            results[index] = logprobs.tolist()
    gathered = [None] * torch.distributed.get_world_size() if torch.distributed.get_rank() == 0 else None
    torch.distributed.gather_object(results, gathered, dst=0)
    if torch.distributed.get_rank() == 0:
        merged = {index: logprobs for part in gathered for index, logprobs in part.items()}
        assert len(merged) == len(records), "every record is scored by some rank"
        lines = [scored_line(record, merged[i]) for i, record in enumerate(records)]
        atomic_write_text(out, "".join(lines))
        nonfinite = sum(not all(map(math.isfinite, logprobs)) for logprobs in merged.values())
        if nonfinite:
            warnings.warn(f"{nonfinite} of {len(records)} sequences have non-finite log-probs (NaN or inf in the "
                          f"model's output): {out} holds null for them, at the positions its {NONFINITE_KEY} lists.",
                          stacklevel=1)
    torch.distributed.barrier()
