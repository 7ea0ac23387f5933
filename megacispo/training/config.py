"""The training sections: the optimizer (``optimizer:``), the run (``train:``) and the supervised
warm start (``sft:``)."""

from __future__ import annotations

from dataclasses import dataclass

from megacispo.fields import AT_LEAST_0, AT_LEAST_1, POSITIVE, Range, check_ranges, ranged


@dataclass(kw_only=True)
class OptimizerConfig:
    """AdamW as MiniMax-M1 set it, with warm-up and cosine decay."""

    lr: float = ranged(1e-4, POSITIVE)
    """Peak learning rate."""
    min_lr: float = ranged(0.0, AT_LEAST_0)
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = ranged(0, AT_LEAST_0)
    """Linear warm-up from 0 over this many optimizer steps."""
    decay_steps: int = ranged(0, Range(0, note="0: decay over the whole run"))
    """Cosine decay to min_lr over this many optimizer steps (0: the whole run), like Megatron's
    lr_decay_iters; set it to keep the schedule fixed when a run is extended or resumed longer."""
    weight_decay: float = ranged(0.0, AT_LEAST_0)
    """Decoupled weight decay."""
    adam_beta1: float = ranged(0.9, Range(0, 1, high_open=True))
    """AdamW beta1."""
    adam_beta2: float = ranged(0.95, Range(0, 1, high_open=True))
    """AdamW beta2."""
    adam_eps: float = ranged(1e-15, POSITIVE)
    """AdamW epsilon; M1's gradients span 1e-18..1e-5, 1e-8 would swamp the small ones."""
    clip_grad: float = ranged(1.0, Range(0, note="0: off"))
    """Clip the global gradient norm to this (0: off)."""
    use_distributed_optimizer: bool = True
    """Shard optimizer states across data-parallel ranks (Megatron's distributed optimizer)."""

    def check(self) -> None:
        check_ranges(self, "optimizer")
        if self.min_lr > self.lr:
            raise ValueError(
                f"optimizer.min_lr = {self.min_lr} exceeds optimizer.lr = {self.lr}: the schedule decays "
                "from lr down to min_lr; lower min_lr"
            )


@dataclass(kw_only=True)
class TrainConfig:
    """The run: length, batching, checkpoints, logs."""

    run_dir: str = "runs/quickstart"
    """Where TensorBoard events, checkpoints and the resolved config go."""
    steps: int = ranged(10, AT_LEAST_1)
    """RL steps (one rollout batch and its K updates each)."""
    seed: int = ranged(1234, AT_LEAST_0)
    """Seeds model initialization, sampling and data order."""
    micro_batch_size: int = ranged(8, AT_LEAST_1)
    """Sequences per micro-batch with pack_sequences off; packed, the default budget is this many of the longest."""
    pack_sequences: bool = True
    """Pack each micro-batch's sequences end to end into one row (exact; false: one right-padded sequence per row)."""
    max_tokens_per_micro_batch: int = ranged(0, Range(0, note="0: micro_batch_size x the pass's longest sequence"))
    """Token budget of a packed micro-batch (0: micro_batch_size x the pass's longest sequence, padding's own size)."""
    balance_data_parallel: bool = True
    """Packed: move sequences between data-parallel ranks so each rank's share of every mini-batch holds about equal tokens (exact)."""
    checkpoint_every: int = ranged(0, Range(0, note="0: only at the end"))
    """Save a checkpoint every this many steps (0: only at the end)."""
    keep_last: int = ranged(2, AT_LEAST_1)
    """Keep this many newest checkpoints."""
    load: str = ""
    """Start from this checkpoint: a megacispo checkpoint or a Hugging Face directory (converted on the fly)."""
    export_hf: str = ""
    """Write the final weights here as a Hugging Face checkpoint, with the tokenizer files (empty: no export)."""
    eval_every: int = ranged(0, Range(0, note="0: at the start and the end only"))
    """Evaluate held-out accuracy every this many steps (0: at the start and the end only)."""
    max_nonfinite_skips: int = ranged(3, AT_LEAST_0)
    """Stop after this many updates skipped for a non-finite loss or gradient."""

    def check(self) -> None:
        if not self.run_dir:
            raise ValueError("train.run_dir is empty: name the directory for the run's checkpoints and logs")
        check_ranges(self, "train")
        if self.max_tokens_per_micro_batch and not self.pack_sequences:
            raise ValueError(
                f"train.max_tokens_per_micro_batch = {self.max_tokens_per_micro_batch} is a budget of packed "
                "micro-batches but train.pack_sequences is false: set train.pack_sequences=true, or "
                "train.max_tokens_per_micro_batch=0 for train.micro_batch_size padded rows"
            )

    def check_fits(self, longest: int, source: str) -> None:
        """ValueError when a sequence of ``longest`` tokens (``source`` says what bounds it) exceeds the
        budget of a packed micro-batch: a sequence is never split over micro-batches."""
        budget = self.max_tokens_per_micro_batch
        if self.pack_sequences and budget and budget < longest:
            raise ValueError(
                f"train.max_tokens_per_micro_batch = {budget} is less than the longest sequence, {longest} tokens "
                f"({source}): a sequence is never split over micro-batches; raise it to {longest} or more, or "
                f"shorten the sequences"
            )


@dataclass(kw_only=True)
class SFTConfig:
    """The supervised warm start (megacispo.sft)."""

    steps: int = ranged(200, AT_LEAST_1)
    """Optimizer steps."""
    batch_size: int = ranged(32, AT_LEAST_1)
    """Prompt/answer pairs per optimizer step."""
    lr: float = ranged(1e-3, POSITIVE)
    """Peak learning rate (warm-up then cosine decay, AdamW settings from optimizer)."""
    decay_steps: int = ranged(0, Range(0, note="0: decay over sft.steps"))
    """Cosine decay over this many steps (0: sft.steps); more than sft.steps stops SFT part-way down the schedule."""
    load: str = ""
    """Start from this checkpoint or Hugging Face directory; empty: random initialization."""
    out: str = ""
    """Where the warm-started checkpoint goes (default: <run_dir>/sft)."""

    def check(self) -> None:
        check_ranges(self, "sft")
