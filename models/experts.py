"""Megatron's SequentialMLP experts with a cheaper forward for CPU decoding and training.

Megatron's SequentialMLP runs every local expert's MLP module on its slice of the permuted tokens,
also when the slice is empty: decoding one token that goes to 2 of 8 experts still calls 8 MLPs,
each two Megatron linears (an autograd function plus tensor-parallel region mappings) and the
SwiGLU, and that Python made about half of a CPU decode step. ``SkipEmptySequentialMLP`` keeps the
module tree, the parameters and ``sharded_state_dict`` of SequentialMLP (it is a subclass that
only replaces ``forward``), so checkpoints, the HF converter and hf_names see the same keys, and
computes each expert as two plain matmuls:

    out_e = (silu(x_e W_gate^T) * (x_e W_up^T) * p_e) W_2^T,   linear_fc1.weight = [W_gate; W_up]

That equals what Megatron's expert linears compute whatever the layout: an expert's linears never
communicate (with expert TP or EP they set ``explicit_expert_comm`` and the token dispatcher does
the all-gather / reduce-scatter; in a world of one the mappings are identities), so each is a local
matmul with this rank's shard, and the gate / up split of a shard is the local chunk, as MLP's glu.

Experts without tokens are skipped when no gradient is recorded (decoding, evaluation). Under
autograd every expert still runs (an empty matmul is cheap): each parameter then gets its gradient,
zero for an idle expert, as with SequentialMLP, so Megatron DDP's per-parameter hooks and
overlapped gradient reduction see every parameter.

Configurations outside plain SwiGLU experts without bias (FP8 / FP4 padding, bias, other
activations, clamped GLU, delayed weight gradients, probabilities applied on the input) run
SequentialMLP's own forward.

``InProcessMoELayer`` is Megatron's MoELayer (same submodules and keys) that, when no gradient is
recorded and every expert and token is in this process (EP = TP = 1: decoding, evaluation),
hands the routed tokens to the experts directly instead of through the token dispatcher, whose
permute / sort / unpermute bookkeeping cost a CPU decode step about as much as the experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.transformer_config import TransformerConfig


def supports_fused_forward(config: TransformerConfig) -> bool:
    """Whether ``SkipEmptySequentialMLP`` computes these experts itself (plain SwiGLU, no bias)."""
    return (
        config.gated_linear_unit
        and config.activation_func is F.silu
        and not config.add_bias_linear
        and not config.use_te_activation_func
        and config.activation_func_clamp_value is None
        and config.glu_linear_offset == 0.0
        and not (config.fp8 or config.fp4)
        and not config.delay_wgrad_compute
        and not config.moe_apply_probs_on_input
    )


class SkipEmptySequentialMLP(SequentialMLP):
    """SequentialMLP (same parameters and checkpoint keys) whose forward calls no Megatron linear
    and, without autograd, skips the experts that got no tokens."""

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """permuted_local_hidden_states [n, H], sorted by local expert; tokens_per_expert [E_local]
        (sums to n); permuted_probs [n] the routing weight of each row. Returns ([n, H], None)."""
        if not supports_fused_forward(self.config):
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        counts = tokens_per_expert.tolist()
        run_idle = torch.is_grad_enabled()
        outputs = []
        start = 0
        for expert, count in zip(self.local_experts, counts):
            if count or run_idle:
                end = start + count
                outputs.append(
                    self._expert_mlp(expert, permuted_local_hidden_states[start:end], permuted_probs[start:end])
                )
                start = end
        if not outputs:
            return permuted_local_hidden_states.new_empty(0, self.config.hidden_size), None
        return (outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)), None

    @staticmethod
    def _expert_mlp(expert: torch.nn.Module, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """One expert on its tokens [m, H] with routing weights [m] -> [m, H], as Megatron's MLP
        computes it (the weight is applied after the SwiGLU, in fp32 when probs are, then cast back)."""
        gate, up = F.linear(tokens, expert.linear_fc1.weight).chunk(2, dim=-1)
        intermediate = F.silu(gate) * up
        intermediate = (intermediate * probs.unsqueeze(-1)).to(intermediate.dtype)
        return F.linear(intermediate, expert.linear_fc2.weight)


class InProcessMoELayer(MoELayer):
    """MoELayer whose no-grad forward with all experts local routes tokens without the dispatcher."""

    def forward(
        self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, None]:
        """hidden_states [s, b, H] -> ([s, b, H], None), as MoELayer.forward."""
        if not self._routes_in_process(intermediate_tensors, padding_mask):
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        return self._forward_in_process(hidden_states), None

    def _routes_in_process(self, intermediate_tensors, padding_mask: torch.Tensor | None) -> bool:
        config = self.config
        return (
            not torch.is_grad_enabled()
            and intermediate_tensors is None
            and padding_mask is None
            and self.attn_tp_group.size() == 1
            and self.token_dispatcher.tp_size == 1
            and self.token_dispatcher.ep_size == 1
            and not self.use_shared_expert
            and not config.moe_latent_size
            and config.moe_expert_capacity_factor is None
        )

    def _forward_in_process(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """What Megatron's permute, experts and unpermute compute in one process: the rows of each
        expert in expert order (then token order), their routing weights, and the experts' outputs
        summed back per token with index_add_ in that same order."""
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, H]
        probs, routing_map = self.route(hidden_states)  # [T, E] fp32, [T, E] bool
        expert_ids, token_ids = routing_map.T.nonzero(as_tuple=True)  # [n] each, sorted by expert
        expert_outputs, _ = self.experts(
            tokens.index_select(0, token_ids), routing_map.sum(dim=0), probs.T[expert_ids, token_ids]
        )  # [n, H]
        output = torch.zeros_like(tokens).index_add_(0, token_ids, expert_outputs.to(tokens.dtype))
        return output.view(hidden_states.shape)
