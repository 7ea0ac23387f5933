"""The training engine: this rank's piece of the policy model, wrapped in Megatron DDP, with the
optimizer (AdamW 0.9 / 0.95 / 1e-15, distributed across data-parallel ranks), the LR schedule, and
the forward(-backward) passes over micro-batches through Megatron-Core's pipeline schedules.

Both training entry points (megacispo.train for RL, megacispo.sft for the warm start) use it;
``build_inference_model`` builds the model alone, for the entry points that only run it
(megacispo.eval, megacispo.score).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import clip_grads, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection

from megacispo.config import Config
from megacispo.models.config import PARAMS_DTYPES, HybridModelConfig, LoraConfig, transformer_config
from megacispo.models.lora import freeze_base, init_adapters
from megacispo.models.model import HybridModel
from megacispo.parallel.layout import ParallelConfig, run_device
from megacispo.parallel.vocab_parallel import lm_head_input, lm_head_logprobs
from megacispo.training.packing import PackedRow, agreed_bins, pack_rows, row_length_multiple


def build_inference_model(
    config: HybridModelConfig, params_dtype: torch.dtype | str, parallel: ParallelConfig, lora: LoraConfig | None = None
) -> HybridModel:
    """This rank's piece of the model for inference (evaluation, scoring, rollout processes), in eval mode,
    without DDP or an optimizer; its weights are left uninitialized: the caller loads them all from a
    checkpoint, or a weight sync sends them. ``params_dtype``: torch.float32 / torch.bfloat16 or its name (a
    checkpoint records the name); ``lora``: the adapters it holds (B starts at zero)."""
    if isinstance(params_dtype, str):
        if params_dtype not in PARAMS_DTYPES:
            raise ValueError(f"params_dtype = {params_dtype!r}: use one of {', '.join(PARAMS_DTYPES)}.")
        params_dtype = PARAMS_DTYPES[params_dtype]
    megatron_config = transformer_config(config, parallel, params_dtype=params_dtype)
    # Every weight comes from the checkpoint: random initialization would only cost time.
    megatron_config.perform_initialization = False
    return HybridModel(
        config, megatron_config, pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(), lora=lora,
    ).eval()


def freeze_routers(model: HybridModel) -> None:
    """model.freeze_router: the routers' weights leave autograd (requires_grad = False) before DDP and
    the optimizer are built, so they get no gradient buffer, no optimizer state and no update; the
    router's output still carries the gradient to the layer's input."""
    for layer in model.decoder.layers:
        layer.mlp.router.weight.requires_grad_(False)


@dataclass
class StepResult:
    """What one optimizer step reports."""

    applied: bool
    """False when the update was skipped for a non-finite gradient."""
    grad_norm: float
    """Global gradient norm before clipping."""
    lr: float
    """Learning rate of this step."""


class Engine:
    """The policy on this rank, its optimizer and schedule, and micro-batched passes over it."""

    def __init__(self, config: Config, total_steps: int, peak_lr: float, decay_steps: int = 0):
        """total_steps: optimizer steps of the run; peak_lr: after warm-up (optimizer.warmup_steps);
        decay_steps: cosine decay to optimizer.min_lr over this many steps (0: total_steps)."""
        self.config = config
        # The model's weights live there, so every tensor the driver makes, collectives' included, does too.
        self.device = run_device()
        self.groups = ProcessGroupCollection.use_mpu_process_groups()
        self.megatron_config = transformer_config(
            config.model, config.parallel, precision=config.precision, recompute=config.recompute
        )
        self.megatron_config.finalize_model_grads_func = finalize_model_grads
        module = HybridModel(
            config.model,
            self.megatron_config,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            lora=config.lora,
        )
        if config.lora.enabled:
            freeze_base(module)
            init_adapters(module, config.train.seed)
        elif config.model.freeze_router:
            freeze_routers(module)
        bf16 = self.megatron_config.bf16
        self.model = DistributedDataParallel(
            self.megatron_config,
            # bf16 weights: gradients accumulate and are reduced in fp32 (M1's 1e-18..1e-5 gradients).
            DistributedDataParallelConfig(
                use_distributed_optimizer=config.optimizer.use_distributed_optimizer, grad_reduce_in_fp32=bf16
            ),
            module,
        )
        opt = config.optimizer
        self.optimizer = get_megatron_optimizer(
            MegatronOptimizerConfig(
                optimizer="adam", lr=peak_lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
                adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps,
                clip_grad=opt.clip_grad, use_distributed_optimizer=opt.use_distributed_optimizer,
                # bf16: the optimizer steps fp32 master copies of the bf16 weights.
                bf16=bf16, params_dtype=self.megatron_config.params_dtype,
            ),
            [self.model],
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if opt.warmup_steps else peak_lr,
            max_lr=peak_lr,
            min_lr=opt.min_lr,
            lr_warmup_steps=opt.warmup_steps,
            lr_decay_steps=max(decay_steps or total_steps, opt.warmup_steps + 1),
            lr_decay_style="cosine",
            start_wd=opt.weight_decay,
            end_wd=opt.weight_decay,
            wd_incr_steps=total_steps,
            wd_incr_style="constant",
        )

    @property
    def module(self) -> HybridModel:
        """The model without its DDP wrapper (generation and checkpoints use it)."""
        return self.model.module

    @property
    def data_parallel_size(self) -> int:
        return torch.distributed.get_world_size(self.groups.dp)

    def run_micro_batches(
        self,
        micro_batches: list,
        forward_step: Callable,
        *,
        forward_only: bool,
    ) -> list[dict]:
        """One pass over ``micro_batches`` through Megatron's schedule (1F1B with PP).

        ``forward_step(batch, model) -> (output, loss_func)``; returns the loss functions' dicts
        (on the last pipeline stage; empty elsewhere).
        """
        if not forward_only:
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        micro_batch_size, seq_length = micro_batches[0].tokens.shape
        seq_length *= self.groups.cp.size()  # the schedule takes a row's whole length and divides it over CP
        iterator = iter(micro_batches)
        return get_forward_backward_func()(
            forward_step_func=lambda data_iterator, model: forward_step(next(data_iterator), model),
            data_iterator=iterator,
            model=[self.model],
            num_microbatches=len(micro_batches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )

    def token_logprobs(
        self,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        loss_mask: torch.Tensor,
        temperature: float = 1.0,
        compute_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [b, T] of ``targets`` under the tempered policy, and its entropy (detached, for
        logging) or None, at the positions where ``loss_mask`` [b, T] is non-zero; 0 elsewhere.
        hidden: the model's final hidden states [S(/TP), b, H] (``model(input,
        return_hidden_states=True)`` on the last stage); targets [b, T], T <= S: the token each of the
        first T input positions predicts (the input shifted by one).

        Through the fused LM head in fp32: each TP rank multiplies by its vocabulary shard a tile of
        tokens at a time, so the [b, S, V] logits are never held whole, not even one rank's shard.
        Only the masked-in positions go through the head (prompts and padding take no log-prob, and
        the head is the largest matmul of a small model's step); the mask is the same on every TP rank.
        """
        head_input = lm_head_input(hidden, self.groups.tp, self.megatron_config.sequence_parallel)
        head_input = head_input[: targets.shape[1]]  # [T, b, H]
        if temperature > 0:
            # (h W^T) / T = (h / T) W^T: the tempered logits without touching the head.
            head_input = head_input / temperature
        positions = loss_mask.T.reshape(-1).nonzero().squeeze(-1)  # [n] into the [T * b] positions
        logprobs, entropy = lm_head_logprobs(
            head_input.reshape(-1, head_input.shape[-1]).index_select(0, positions),
            self.module.lm_head_weight, targets.T.reshape(-1)[positions], self.groups.tp,
            compute_entropy=compute_entropy,
        )  # [n]

        def scatter(values: torch.Tensor) -> torch.Tensor:
            return values.new_zeros(targets.numel()).index_copy(0, positions, values).view(targets.T.shape).T

        return scatter(logprobs), None if entropy is None else scatter(entropy)

    @property
    def length_multiple(self) -> int:
        """What every row's length is a multiple of (``row_length_multiple``)."""
        return row_length_multiple(self.config.parallel, fp8=self.config.precision.fp8 is not None)

    def packed_rows(self, lengths: list[int], batch_width: int) -> list[PackedRow]:
        """The packed micro-batches of sequences of ``lengths`` (host ints) right-padded to ``batch_width``:
        rows of train.max_tokens_per_micro_batch tokens (0: train.micro_batch_size x ``batch_width``), as
        many on every data-parallel rank, each holding this CP rank's share (a replica's CP ranks pack
        the same rows)."""
        train = self.config.train
        budget = train.max_tokens_per_micro_batch or train.micro_batch_size * batch_width
        num_bins = agreed_bins(lengths, budget, self.groups.dp, self.device)
        return pack_rows(lengths, batch_width, budget, num_bins, self.length_multiple, self.device,
                         cp_size=self.groups.cp.size(), cp_rank=self.groups.cp.rank())

    def padded_length(self, length: int) -> int:
        """``length`` right-padded to ``length_multiple``."""
        return -(-length // self.length_multiple) * self.length_multiple

    def loss_scale_for_schedule(self, num_micro_batches: int) -> float:
        """Megatron's schedule divides each micro-batch loss by the number of micro-batches and DDP
        averages gradients over data-parallel ranks. Our losses are already normalized by the
        global token count of the step (megacispo.rl.losses.compute_global_counts), so they are scaled
        up by exactly what Megatron divides by: the step then optimizes the global objective. (Under
        context parallelism DDP averages over DP x CP, and the schedule multiplies the loss by CP.)"""
        return float(num_micro_batches * self.data_parallel_size)

    def step(self) -> StepResult:
        """Apply the accumulated gradients, clipped to optimizer.clip_grad, unless their norm is not
        finite. This is Megatron's ChainedOptimizer.step with the finiteness check added between the
        norm and the update, taking the norm (a pass over every gradient) once."""
        # DDP's buffers into the optimizer's gradients (the fp32 master gradients with bf16 weights).
        self.optimizer.prepare_grads()
        grad_norm = self.optimizer.get_grad_norm()
        lr = self.optimizer.param_groups[0]["lr"]
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad()
            return StepResult(applied=False, grad_norm=grad_norm, lr=lr)
        clip_grad = self.config.optimizer.clip_grad
        if clip_grad > 0:
            for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                parameters = optimizer.get_parameters()
                if parameters and not getattr(optimizer, "is_stub_optimizer", False):
                    # Looked up at call time: the CPU back-end replaces it after this module is imported.
                    clip_grads.clip_grad_by_total_norm_fp32(parameters, clip_grad, grad_norm)
        self.optimizer.step_with_ready_grads()
        self.scheduler.step(increment=1)
        return StepResult(applied=True, grad_norm=grad_norm, lr=lr)

    def train(self, mode: bool = True) -> None:
        self.model.train(mode)
