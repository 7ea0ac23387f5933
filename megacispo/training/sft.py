"""The supervised warm start ("cold start" before RL) on prompt/answer pairs, behind the entry point
megacispo.sft.

Same model, same parallel stack and engine as RL; the loss is the token-level cross-entropy of the
answer (and EOS) tokens, normalized by the global number of answer tokens of the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from megacispo.checkpoint.distributed import CheckpointError, save_checkpoint
from megacispo.checkpoint.hf import load_start_weights
from megacispo.config import Config, to_dict
from megacispo.data.padding import pad_right
from megacispo.data.prompts import PromptRecord, PromptSampler, SFTBatch, build_sft_example, collate_sft
from megacispo.data.tokenizer import Tokenizer
from megacispo.lifeline import start_group_reaper
from megacispo.metrics.logger import MetricsLogger, format_console_line, is_logging_rank
from megacispo.parallel.layout import destroy_distributed, init_distributed
from megacispo.rl.losses import Sequences, count_loss_tokens, reduce_metrics
from megacispo.startup import bad_input_exits
from megacispo.training.engine import Engine
from megacispo.training.packing import PackedRow

# A console line with the metrics every this many steps (and at the last); the bar shows the rest.
CONSOLE_EVERY = 50


@dataclass
class SFTMicroBatch:
    """One micro-batch of next-token prediction, each tensor [b, T] (a packed row: [1, W])."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    padding_mask: torch.Tensor
    packed: PackedRow | None = None
    """Where the pairs of a packed row lie in it; None: one pair per row."""

    @property
    def sequences(self) -> Sequences:
        return Sequences.rows(self.loss_mask) if self.packed is None else self.packed.sequences


class SFTTrainer:
    """Runs the SFT steps of ``config`` on this rank: each step draws sft.batch_size pairs (this rank's
    data-parallel slice), takes one optimizer step on their cross-entropy and logs it. The logging rank
    draws a progress bar with the rate and the time left, writes every step's metrics to TensorBoard,
    and prints a console line every CONSOLE_EVERY steps."""

    def __init__(self, config: Config, engine: Engine, tokenizer: Tokenizer, pairs: list[PromptRecord],
                 logger: MetricsLogger):
        self.config, self.engine, self.tokenizer, self.logger = config, engine, tokenizer, logger
        self.sampler = PromptSampler(pairs, seed=config.train.seed)
        self.dp_rank = torch.distributed.get_rank(engine.groups.dp)
        self.dp_size = torch.distributed.get_world_size(engine.groups.dp)
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
        # Each rank's tokens are its own: its data-parallel share, its CP share of every row.
        counts = count_loss_tokens([micro.loss_mask for micro in micro_batches], group=engine.groups.dp_cp,
                                   sequences=[micro.sequences for micro in micro_batches])
        scale = engine.loss_scale_for_schedule(len(micro_batches))

        def forward_step(micro: SFTMicroBatch, model):
            hidden = model(micro.tokens, return_hidden_states=True, padding_mask=micro.padding_mask,
                           packed_seq_params=None if micro.packed is None else micro.packed.packed_seq_params)

            def loss_func(output):
                logprobs, _ = engine.token_logprobs(output, micro.labels, micro.loss_mask)
                loss = -(logprobs * micro.loss_mask).sum() / counts.num_tokens.clamp(min=1)
                return loss * scale, {"sft/loss": loss.detach().clone()}

            return hidden, loss_func

        outputs = engine.run_micro_batches(micro_batches, forward_step, forward_only=False)
        result = engine.step()
        # Only the last pipeline stage computes the loss (and only it logs).
        metrics = {"sft/loss": float(reduce_metrics(outputs, group=engine.groups.dp_cp)["sft/loss"])} if outputs else {}
        return {**metrics, "perf/grad_norm": result.grad_norm, "perf/lr": result.lr}

    def save(self, root: Path) -> None:
        """The model's checkpoint of the last step under ``root`` (no optimizer: RL starts its own)."""
        save_checkpoint(root, self.step, self.engine.module, config_dict=to_dict(self.config), keep_last=1)

    def _micro_batches(self) -> list[SFTMicroBatch]:
        """This rank's slice of the next global batch: packed rows of train.max_tokens_per_micro_batch
        tokens, as many on every data-parallel rank (train.pack_sequences), or right-padded to the
        engine's length in train.micro_batch_size pieces."""
        records = self.sampler.next_batch(self.per_rank * self.dp_size)
        mine = records[self.dp_rank * self.per_rank:(self.dp_rank + 1) * self.per_rank]
        examples = [build_sft_example(self.tokenizer, record) for record in mine]
        batch = collate_sft(examples, self.tokenizer.pad_id)
        train, pad_id = self.config.train, self.tokenizer.pad_id
        if train.pack_sequences:
            batch = batch.to(self.engine.device)
            rows = self.engine.packed_rows([len(example.token_ids) - 1 for example in examples],
                                           batch.input_ids.shape[1])
            return [SFTMicroBatch(row.pack(batch.input_ids, pad_id), row.pack(batch.labels, pad_id),
                                  row.pack(batch.loss_mask), row.pack(batch.padding_mask, True), row) for row in rows]
        batch = _pad_to(batch, self.engine.padded_length(batch.input_ids.shape[1]), pad_id).to(self.engine.device)
        size = train.micro_batch_size
        return [SFTMicroBatch(batch.input_ids[i:i + size], batch.labels[i:i + size], batch.loss_mask[i:i + size],
                              batch.padding_mask[i:i + size]) for i in range(0, self.per_rank, size)]


def _pad_to(batch: SFTBatch, length: int, pad_id: int) -> SFTBatch:
    """Right-pad an SFTBatch's [b, T] tensors to ``length`` (padding is masked out of the loss)."""
    return type(batch)(pad_right(batch.input_ids, length, pad_id), pad_right(batch.labels, length, pad_id),
                       pad_right(batch.loss_mask, length, 0.0), pad_right(batch.padding_mask, length, True))


def run_sft(config: Config, tokenizer: Tokenizer, pairs: list[PromptRecord]) -> None:
    """The SFT run of a config checked at start-up: train, save the checkpoint under sft.out."""
    sft = config.sft
    # Megatron-Core's checkpoint writer starts a Manager process that would outlive a killed rank.
    start_group_reaper()
    init_distributed(config.parallel, config.train.seed, config.precision.fp32_matmul)
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
