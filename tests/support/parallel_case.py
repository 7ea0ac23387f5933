"""What the parallel-equivalence tests share: one forward-backward of a Megatron model over a fixed
global batch through Megatron's schedule (run in each rank), and the layout-independent comparison
of its loss, gradients and parameters with the single-process run."""

from __future__ import annotations

import types

import torch


def forward_backward(ddp_model, tokens: torch.Tensor, num_microbatches: int, forward) -> dict:
    """Run this rank's data-parallel share of ``tokens`` [global batch, seq + 1] in
    ``num_microbatches`` micro-batches; ``forward(model, batch) -> per-token loss``. Returns the
    mean micro-batch loss (last stage), and this rank's gradient and parameter pieces."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megacispo.parallel.sharded import gradient_pieces, parameter_pieces

    local = tokens.chunk(parallel_state.get_data_parallel_world_size())[parallel_state.get_data_parallel_rank()]

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        # Cloned: the schedule divides the returned loss in place by the number of micro-batches.
        return loss, {"lm loss": loss.detach().clone()}

    def forward_step(data_iterator, model):
        return forward(model, next(data_iterator)), loss_func

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(local.chunk(num_microbatches)), model=[ddp_model],
        num_microbatches=num_microbatches, seq_length=tokens.shape[1] - 1,
        micro_batch_size=local.shape[0] // num_microbatches,
    )
    return {
        "loss": torch.stack([item["lm loss"] for item in losses]).mean() if losses else None,
        "last_stage": parallel_state.is_pipeline_last_stage(),
        "grads": gradient_pieces(ddp_model.module),
        "params": parameter_pieces(ddp_model.module),
    }


def tiny_ddp_model(layout: dict, load_dir: str | None = None, save_dir: str | None = None, lora=None,
                   **config_options):
    """This rank's tiny model at ``layout`` (ParallelConfig's fields; torch.distributed started here) in
    Megatron DDP, with its model config and TransformerConfig (``config_options``: transformer_config's):
    its weights loaded from ``load_dir`` (a dist checkpoint), or saved to ``save_dir`` as they start.
    ``lora``: a LoraConfig, whose adapters alone train; saved with B drawn at random (std 0.05), so that
    every adapter gets a gradient."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from megacispo.models.config import model_config, model_shape, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed, validate_layout, world_size_from_env

    model_cfg = model_config("tiny")
    parallel = ParallelConfig(**layout)
    validate_layout(parallel, world_size_from_env(), model_shape(model_cfg))
    init_distributed(parallel, seed=1234)
    config = transformer_config(model_cfg, parallel, **config_options)
    model = HybridModel(
        model_cfg, config,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        lora=lora,
    )
    if lora is not None:
        from megacispo.models.lora import freeze_base

        freeze_base(model)
        if save_dir is not None:
            generator = torch.Generator().manual_seed(5)
            for name, param in model.named_parameters():
                if name.endswith(("lora_A", "lora_B")):
                    param.data.normal_(0.0, 0.05, generator=generator)
    if load_dir is not None:
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), load_dir))
    if save_dir is not None:
        dist_checkpointing.save(model.sharded_state_dict(), save_dir)
    ddp_model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    config.finalize_model_grads_func = finalize_model_grads
    return ddp_model, model_cfg, config


def global_loss(results) -> torch.Tensor:
    """The global-batch loss: the mean over data-parallel replicas of the last stage's losses."""
    return torch.stack([r["loss"] for r in results if r["last_stage"]]).mean()


def assert_close_by_key(expected: dict, actual: dict, what: str, rtol: float = 1e-5) -> None:
    """Every tensor within ``rtol`` of the largest magnitude of its expected value."""
    assert expected.keys() == actual.keys(), f"{what}: keys differ: {sorted(expected.keys() ^ actual.keys())}"
    for key in expected:
        scale = expected[key].abs().max().clamp_min(1e-8)
        error = (expected[key] - actual[key]).abs().max() / scale
        assert error <= rtol, f"{what} {key}: relative error {error:.2e} > {rtol:.0e}"


def one_update(engine, tokens: torch.Tensor):
    """One optimizer step of ``engine`` on a made-up loss (the mean log-sum-exp of the logits of
    ``tokens`` [b, s]): Engine.step's result, and by parameter name whether the step moved it."""
    module = engine.module
    before = {name: param.detach().clone() for name, param in module.named_parameters()}

    def forward_step(batch, model):
        logits = model(batch.tokens)
        return logits, lambda output: (output.float().logsumexp(-1).mean(), {})

    engine.run_micro_batches([types.SimpleNamespace(tokens=tokens)], forward_step, forward_only=False)
    result = engine.step()
    return result, {name: not torch.equal(before[name], param.detach()) for name, param in module.named_parameters()}


def save_random_tiny_checkpoint(root: str, step: int, init_std: float, size: str = "tiny") -> None:
    """The tiny model (or another size: tiny-m2) with random weights (std ``init_std``, seed 3) as a
    one-process checkpoint at ``step`` that train.load / --load read; run it in a process of its own
    (run_distributed)."""
    from megacispo.checkpoint.distributed import save_checkpoint
    from megacispo.config import Config, to_dict
    from megacispo.models.config import model_config, transformer_config
    from megacispo.models.model import HybridModel
    from megacispo.parallel.layout import ParallelConfig, init_distributed

    config, parallel = model_config(size), ParallelConfig()
    init_distributed(parallel, seed=3)
    model = HybridModel(config, transformer_config(config, parallel, init_method_std=init_std))
    save_checkpoint(root, step, model, config_dict=to_dict(Config(model=config)), keep_last=None)
