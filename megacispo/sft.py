"""Supervised warm start ("cold start" before RL) on prompt/answer pairs:
``torchrun --nproc-per-node N -m megacispo.sft --config X.yaml [--set k=v ...] [--load DIR]``.

Same model, same parallel stack and engine as RL; the loss is the token-level cross-entropy of the
answer (and EOS) tokens, normalized by the global number of answer tokens of the step.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from megacispo.checkpoint import CheckpointError, save_checkpoint
from megacispo.cli import bad_input_exits, build_parser, load_sft_data, load_tokenizer, plan, start_up
from megacispo.config import Config, check_sft_batches, to_dict
from megacispo.data import PromptRecord, PromptSampler, SFTBatch, build_sft_example, collate_sft
from megacispo.hf_checkpoint import check_start_weights, load_start_weights
from megacispo.losses import count_loss_tokens, reduce_metrics
from megacispo.metrics import MetricsLogger, format_console_line, is_logging_rank
from megacispo.tokenizer import Tokenizer

if TYPE_CHECKING:
    from megacispo.engine import Engine

# A console line with the metrics every this many steps (and at the last); the bar shows the rest.
CONSOLE_EVERY = 50


@dataclass
class SFTMicroBatch:
    """One micro-batch of next-token prediction, each tensor [b, T]."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    padding_mask: torch.Tensor


class SFTTrainer:
    """Runs the SFT steps of ``config`` on this rank: each step draws sft.batch_size pairs (this rank's
    data-parallel slice), takes one optimizer step on their cross-entropy and logs it. The logging rank
    draws a progress bar with the rate and the time left, writes every step's metrics to TensorBoard,
    and prints a console line every CONSOLE_EVERY steps."""

    def __init__(self, config: Config, engine: Engine, tokenizer: Tokenizer, pairs: list[PromptRecord],
                 logger: MetricsLogger):
        self.config, self.engine, self.tokenizer, self.logger = config, engine, tokenizer, logger
        self.sampler = PromptSampler(pairs, seed=config.train.seed)
        self.dp_rank = torch.distributed.get_rank(engine.dp_group)
        self.dp_size = torch.distributed.get_world_size(engine.dp_group)
        self.per_rank = config.sft.batch_size // self.dp_size
        self.step = 0

    def fit(self) -> None:
        """Train to sft.steps."""
        steps = self.config.sft.steps
        with tqdm(total=steps, desc="sft", unit="step", disable=not self.logger.enabled) as bar:
            while self.step < steps:
                metrics = self.train_step()
                self.step += 1
                self.logger.log(self.step, metrics)
                bar.update(1)
                if "sft/loss" in metrics:
                    bar.set_postfix(loss=f"{metrics['sft/loss']:.4f}", refresh=False)
                if self.logger.enabled and (self.step % CONSOLE_EVERY == 0 or self.step == steps):
                    bar.write(format_console_line(self.step, metrics))

    def train_step(self) -> dict[str, float]:
        """One optimizer step on this rank's share of sft.batch_size pairs; the step's metrics."""
        engine = self.engine
        micro_batches = self._micro_batches()
        counts = count_loss_tokens([micro.loss_mask for micro in micro_batches], group=engine.dp_group)
        scale = engine.loss_scale_for_schedule(len(micro_batches))

        def forward_step(micro: SFTMicroBatch, model):
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
        return {**metrics, "perf/grad_norm": result.grad_norm, "perf/lr": result.lr}

    def save(self, root: Path) -> None:
        """The model's checkpoint of the last step under ``root`` (no optimizer: RL starts its own)."""
        save_checkpoint(root, self.step, self.engine.module, config_dict=to_dict(self.config), keep_last=1)

    def _micro_batches(self) -> list[SFTMicroBatch]:
        """This rank's slice of the next global batch, right-padded to the engine's length, in
        train.micro_batch_size pieces."""
        records = self.sampler.next_batch(self.per_rank * self.dp_size)
        mine = records[self.dp_rank * self.per_rank:(self.dp_rank + 1) * self.per_rank]
        batch = collate_sft([build_sft_example(self.tokenizer, record) for record in mine], self.tokenizer.pad_id)
        batch = _pad_to(batch, self.engine.padded_length(batch.input_ids.shape[1]), self.tokenizer.pad_id)
        batch = batch.to(self.engine.device)
        size = self.config.train.micro_batch_size
        return [SFTMicroBatch(batch.input_ids[i:i + size], batch.labels[i:i + size], batch.loss_mask[i:i + size],
                              batch.padding_mask[i:i + size]) for i in range(0, self.per_rank, size)]


def _pad_to(batch: SFTBatch, length: int, pad_id: int) -> SFTBatch:
    """Right-pad an SFTBatch's [b, T] tensors to ``length`` (padding is masked out of the loss)."""
    extra = length - batch.input_ids.shape[1]
    pad = torch.nn.functional.pad
    return type(batch)(pad(batch.input_ids, (0, extra), value=pad_id), pad(batch.labels, (0, extra), value=pad_id),
                       pad(batch.loss_mask, (0, extra), value=0.0), pad(batch.padding_mask, (0, extra), value=True))


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

    # After the dry run, which must not import Megatron-Core (tests/test_examples.py): these do.
    from megacispo.engine import Engine
    from megacispo.parallel.layout import destroy_distributed, init_distributed

    sft = config.sft
    init_distributed(config.parallel, config.train.seed)
    engine = Engine(config, total_steps=sft.steps, peak_lr=sft.lr, decay_steps=sft.decay_steps)
    if sft.load:
        with bad_input_exits(CheckpointError):  # raised on every rank alike
            load_start_weights("sft.load", sft.load, engine)
    out_dir = Path(sft.out or Path(config.train.run_dir) / "sft")
    logger = MetricsLogger.from_config(config, enabled=is_logging_rank(), run_dir=out_dir, console=False)
    trainer = SFTTrainer(config, engine, tokenizer, pairs, logger)
    trainer.fit()
    trainer.save(out_dir / "checkpoints")
    if logger.enabled:
        print(f"SFT checkpoint: {out_dir / 'checkpoints'}")
    logger.close()
    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
