"""Supervised warm start ("cold start" before RL) on prompt/answer pairs:
``torchrun --nproc-per-node N -m megacispo.sft --config X.yaml [--set k=v ...]``.

Same model, same parallel stack and engine as RL; the loss is the token-level cross-entropy of the
answer (and EOS) tokens, normalized by the global number of answer tokens of the step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from megacispo.checkpoint import CheckpointError, save_checkpoint
from megacispo.cli import bad_input_exits, build_parser, load_sft_data, load_tokenizer, plan, start_up
from megacispo.config import check_sft_batches
from megacispo.hf_checkpoint import check_start_weights, load_start_weights


def main(argv: list[str] | None = None) -> int:
    args = build_parser(__doc__, load_field="sft.load").parse_args(argv)
    with bad_input_exits():
        config, world_size = start_up(args, check_sft_batches)
        if args.dry_run:
            print(plan(config, world_size))
            return 0
        tokenizer = load_tokenizer(config)
        pairs = load_sft_data(config, tokenizer)
        if config.sft.load:  # checked before anything is built
            check_start_weights("sft.load", config.sft.load, config.model)

    from megatron.core import parallel_state

    from megacispo.config import to_dict
    from megacispo.data import PromptSampler, build_sft_example, collate_sft
    from megacispo.engine import Engine
    from megacispo.losses import compute_global_counts, reduce_metrics
    from megacispo.metrics import MetricsLogger, is_logging_rank
    from megacispo.parallel.layout import destroy_distributed, init_distributed

    sft = config.sft
    init_distributed(config.parallel, config.train.seed)
    engine = Engine(config, total_steps=sft.steps, peak_lr=sft.lr, decay_steps=sft.decay_steps)
    if config.sft.load:
        with bad_input_exits(CheckpointError):  # raised on every rank alike
            load_start_weights("sft.load", config.sft.load, engine)
    out_dir = Path(sft.out or Path(config.train.run_dir) / "sft")
    logger = MetricsLogger.from_config(config, enabled=is_logging_rank(), run_dir=out_dir)
    sampler = PromptSampler(pairs, seed=config.train.seed)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    per_rank = sft.batch_size // dp_size

    for step in range(1, sft.steps + 1):
        records = sampler.next_batch(per_rank * dp_size)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        batch = collate_sft([build_sft_example(tokenizer, r) for r in records], tokenizer.pad_id)
        batch = _pad_to(batch, engine.padded_length(batch.input_ids.shape[1]), tokenizer.pad_id).to(engine.device)
        size = config.train.micro_batch_size
        micro_batches = [_Micro(batch.input_ids[i:i + size], batch.labels[i:i + size], batch.loss_mask[i:i + size],
                                batch.padding_mask[i:i + size]) for i in range(0, per_rank, size)]
        counts = compute_global_counts([m.loss_mask for m in micro_batches],
                                       [torch.zeros_like(m.loss_mask) for m in micro_batches], group=engine.dp_group)
        scale = engine.loss_scale_for_schedule(len(micro_batches))

        def forward_step(micro: _Micro, model):
            hidden = model(micro.tokens, return_hidden_states=True, padding_mask=micro.padding_mask)

            def loss_func(output):
                logprobs, _ = engine.token_logprobs(output, micro.labels, micro.loss_mask)
                loss = -(logprobs * micro.loss_mask).sum() / counts.num_tokens.clamp(min=1)
                return loss * scale, {"sft/loss": loss.detach().clone()}

            return hidden, loss_func

        outputs = engine.run_micro_batches(micro_batches, forward_step, forward_only=False)
        result = engine.step()
        # Only the last pipeline stage computes the loss (and only it logs).
        metrics = {"sft/loss": float(reduce_metrics(outputs, group=engine.dp_group)["sft/loss"])} if outputs else {}
        logger.log(step, {**metrics, "perf/grad_norm": result.grad_norm, "perf/lr": result.lr})
    save_checkpoint(out_dir / "checkpoints", sft.steps, engine.module, config_dict=to_dict(config), keep_last=1)
    if logger.enabled:
        print(f"SFT checkpoint: {out_dir / 'checkpoints'}")
    logger.close()
    destroy_distributed()
    return 0


def _pad_to(batch, length: int, pad_id: int):
    """Right-pad an SFTBatch's [b, T] tensors to ``length`` (padding is masked out of the loss)."""
    extra = length - batch.input_ids.shape[1]
    pad = torch.nn.functional.pad
    return type(batch)(pad(batch.input_ids, (0, extra), value=pad_id), pad(batch.labels, (0, extra), value=pad_id),
                       pad(batch.loss_mask, (0, extra), value=0.0), pad(batch.padding_mask, (0, extra), value=True))


class _Micro:
    """One micro-batch of next-token prediction: tokens / labels / loss_mask / padding_mask [b, T]."""

    def __init__(self, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor, padding_mask: torch.Tensor):
        self.tokens, self.labels, self.loss_mask, self.padding_mask = tokens, labels, loss_mask, padding_mask


if __name__ == "__main__":
    sys.exit(main())
