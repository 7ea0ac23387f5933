"""Transformer Engine's grouped linears, twinned for a machine without Transformer Engine: the MoE
layer of the Transformer Engine backend (models.decoder_layer.te_moe_spec: InProcessMoELayer with
Megatron's TEGroupedMLP as StackingTEGroupedMLP) built and run on a CPU, so that tests compare its
lean decode step with Megatron's own TEGroupedMLP forward.

A twin has what TEGroupedMLP and the lean step use of TE's GroupedLinear: one module per projection
holding ``weight{i}`` [out, in] for local expert i (read by name, as GroupedLinear reads them:
``getattr(self, f"weight{i}")``), this rank's expert-TP shard of it (the column twin splits the
output, the row twin the input, and neither communicates: experts leave that to the token
dispatcher, as TE's expert linears do), called on rows sorted by expert with their counts
``m_splits`` -> (output, None). Its GEMMs are plain bf16 / fp32 / fp64 matmuls, never FP8.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import torch
import torch.nn.functional as F
from megatron.core.utils import divide

from megacispo.models import decoder_layer
from megacispo.models.layers import parameter_device


class _GroupedLinearTwin(torch.nn.Module):
    """``weight{i}`` [output_size, input_size] for each of ``num_gemms`` experts (this rank's shard)."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config, init_method, **unused) -> None:
        super().__init__()
        self.num_gemms = num_gemms
        for i in range(num_gemms):
            weight = torch.empty(output_size, input_size, dtype=config.params_dtype, device=parameter_device(config))
            init_method(weight)
            self.register_parameter(f"weight{i}", torch.nn.Parameter(weight))

    def forward(self, rows: torch.Tensor, m_splits: list[int]) -> tuple[torch.Tensor, None]:
        """rows [n, input] sorted by expert, m_splits[i] of them for expert i -> ([n, output], None)."""
        outputs = [F.linear(part, getattr(self, f"weight{i}")) for i, part in enumerate(rows.split(m_splits))]
        return torch.cat(outputs), None


class ColumnGroupedLinearTwin(_GroupedLinearTwin):
    """TEColumnParallelGroupedLinear's twin: each rank holds its expert-TP share of the outputs."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, pg_collection, **kwargs) -> None:
        super().__init__(num_gemms, input_size, divide(output_size, pg_collection.expt_tp.size()), **kwargs)


class RowGroupedLinearTwin(_GroupedLinearTwin):
    """TERowParallelGroupedLinear's twin: each rank holds its expert-TP share of the inputs."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, pg_collection, **kwargs) -> None:
        super().__init__(num_gemms, divide(input_size, pg_collection.expt_tp.size()), output_size, **kwargs)


def twin_te_moe_spec(num_experts: int, lora=None):
    """models.decoder_layer.te_moe_spec (with its LoRA argument) with the twins in place of TE's grouped linears."""
    spec = decoder_layer.te_moe_spec(num_experts, lora)
    experts = spec.submodules.experts
    linears = dataclasses.replace(
        experts.submodules,
        linear_fc1=dataclasses.replace(experts.submodules.linear_fc1, module=ColumnGroupedLinearTwin),
        linear_fc2=dataclasses.replace(experts.submodules.linear_fc2, module=RowGroupedLinearTwin),
    )
    experts = dataclasses.replace(experts, submodules=linears)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, experts=experts))


@contextlib.contextmanager
def te_experts_twinned() -> Iterator[None]:
    """Models built within take the Transformer Engine backend's MoE layer, with twin grouped linears,
    and keep the local backend's mixers (models.decoder_layer.layer_backend's local choice)."""
    local = decoder_layer.LOCAL_BACKEND
    decoder_layer.LOCAL_BACKEND = dataclasses.replace(local, name="local, twin TE experts", moe=twin_te_moe_spec)
    try:
        yield
    finally:
        decoder_layer.LOCAL_BACKEND = local
