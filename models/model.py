"""HybridModel: the MiniMax-M1 style hybrid lightning-attention MoE decoder on Megatron-Core.

    embedding (VocabParallelEmbedding, no position embedding)
    -> decoder: Megatron's TransformerBlock of HybridDecoderLayers (this pipeline stage's layers,
       global layer numbers in the checkpoint keys) and the final RMSNorm
    -> untied LM head (ColumnParallelLinear, vocab-sharded), in fp32 with fp32_lm_head

It follows GPTModel's conventions, so Megatron's schedules, DDP, optimizer and dist checkpointing
use it unchanged: forward(input_ids, position_ids, attention_mask, labels=...) returns
vocab-sharded logits [b, s, V/TP], or with labels the per-token cross-entropy [b, s]; on a
pipeline stage without the head it returns the hidden states for the next stage.

Decoding (``prefill`` / ``decode_step``) batches left-padded prompts: pad tokens are masked as
keys in softmax layers and get zero keys and values in lightning layers, whose state therefore
stays exactly zero until a sequence's first real token. RoPE positions count real tokens only, per
row: the rollout's slot engine refills a finished row with a new prompt's prefill
(``InferenceCache.write_rows``), so the rows' positions and valid lengths differ.
It runs on the training model itself (a model built with sequence parallelism decodes as a plain
TP model); under pipeline parallelism the stages decode one after the other.

Context parallelism (CP, the pg_collection's ``cp`` group of size > 1) splits the training
forwards (no inference_context) along the sequence: each CP rank gets its zigzag share
(``megacispo.parallel.context.zigzag_positions``) of one packed row, and ``forward`` hands the
layers packed_seq_params whose ``cp_group`` is that group. Lightning layers exchange their chunk
states (models/lightning_cp.py: 2 [heads, d, d] fp32 states sent per rank and layer, whatever the
length), softmax layers all-gather K and V of the whole row (models/softmax_cp.py: [N, kv heads, d]
each per rank and layer), RoPE takes each token's position within its
document; the embedding, norms, MoE and LM head are per token. What it saves: every activation but
the softmax layers' gathered K and V is divided by CP. Decoding never splits: each CP rank decodes
its own sequences whole, as a plain model (the rollouts use CP ranks as generation replicas).

A decode step in eval mode takes a lean path: the same modules and parameters, called through
their ``step`` methods (plain matmuls on this rank's weight shards, the router's math without
Megatron's router module, no TransformerBlock), which compute what the Megatron modules compute
for one token at a fraction of the per-op overhead, with a fixed number of ops and no host sync.
Under TP it adds the row-parallel outputs with one all-reduce each (the mixer's output projection,
the experts' expert-TP shards), gathers the lightning norm's rows and the LM head's vocabulary
shards: every TP rank holds the step's tokens, so no dispatcher or sequence split runs. Under EP,
when the EP ranks decode as many rows (``InferenceCache.rows_agree``), each MoE layer gathers the
group's tokens and reduce-scatters its experts' sums instead of the all-to-all (an EP group within
the TP group, whose ranks hold the same tokens, all-reduces them). Each sublayer adds the residual in
its last product. Local and Transformer Engine layers take it alike (its products are plain bf16
matmuls on their weights; rollouts run outside FP8). Prefill, FP8 GEMMs and EP ranks whose rows
differ use the Megatron modules; ``lean_decode = False`` forces them for decode steps too. The
compiled step (``decode_step(compiled=True)``) traces the lean path at any TP and EP, its collectives
in the graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import Iterator

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_pg_rank

from megacispo.models.compiling import code_copy
from megacispo.models.config import SOFTMAX, HybridModelConfig, LoraConfig
from megacispo.models.decoder_layer import block_spec
from megacispo.models.layers import (
    AttentionStep,
    InferenceCache,
    RotaryEmbedding,
    StacksWeights,
    all_gather_columns,
    at_least_fp32,
    release_rollout_tensors,
    rollout_tensor,
)
from megacispo.models.lora import adapted_linears
from megacispo.models.routing import LayerRoutes, RoutingTargets, local_targets
from megacispo.parallel.context import positions_in_documents, zigzag_positions
from megacispo.parallel.layout import broadcast_from_last_stage


class HybridModel(LanguageModule):
    """One pipeline stage (all of it when PP = 1) of the hybrid model.

    hybrid_config: the architecture; config: Megatron's TransformerConfig for it under the
    parallel layout (``models.config.transformer_config``); pre_process / post_process: this stage
    holds the embedding / the final norm and LM head; lora: the low-rank adapters (models/lora.py).
    """

    def __init__(
        self,
        hybrid_config: HybridModelConfig,
        config: TransformerConfig,
        pre_process: bool = True,
        post_process: bool = True,
        pg_collection: ProcessGroupCollection | None = None,
        vp_stage: int | None = None,
        lora: LoraConfig | None = None,
    ) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        self.hybrid_config = hybrid_config
        self.pre_process = pre_process
        self.post_process = post_process
        self.vp_stage = vp_stage
        self.model_type = ModelType.encoder_or_decoder
        self.share_embeddings_and_output_weights = False
        self.vocab_size = hybrid_config.vocab_size
        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config=config, vocab_size=hybrid_config.vocab_size,
                max_sequence_length=hybrid_config.max_position_embeddings,
                position_embedding_type="none", tp_group=self.pg_collection.tp,
            )
        self.rotary = RotaryEmbedding(hybrid_config.rotary_dim, hybrid_config.rotary_base)
        self.decoder = TransformerBlock(
            config=config,
            spec=block_spec(hybrid_config, config, get_pg_rank(self.pg_collection.pp), vp_stage, lora),
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=self.pg_collection,
            vp_stage=vp_stage,
        )
        # Megatron's collection leaves a group it was not given unset (an AttributeError on access).
        self._cp_group = getattr(self.pg_collection, "cp", None)
        self._has_softmax_layers = any(
            hybrid_config.layer_kind(layer.layer_number - 1) == SOFTMAX for layer in self.decoder.layers
        )
        if post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size, hybrid_config.vocab_size, config=config, init_method=config.init_method,
                bias=False, gather_output=False, tp_group=self.pg_collection.tp,
            )
        self.setup_embeddings_and_output_layer()
        self.lean_decode = True
        """Decode steps run the lean path where it applies (``_lean_step_applies``); False runs them
        through Megatron's modules like prefill (tests compare the two)."""
        # Attached after the MoE layers are built: InProcessMoELayer's lean step takes a router
        # without Megatron's own replay, and this hook changes nothing until targets are set.
        for layer in self.decoder.layers:
            layer.mlp.router.router_replay = LayerRoutes(layer.layer_number - 1)
        # The lean path's condition that is fixed at construction: the residual stream keeps the model's
        # dtype. Local and Transformer Engine layers alike: the lean step multiplies their weights
        # itself, outside FP8 (``_lean_step_applies``: FP8 is off within generation_dtype).
        self._tp_size = self.pg_collection.tp.size()
        self._lean_step_supported = not config.fp32_residual_connection
        # Under TP every MoE layer must step without a dispatcher (a Megatron MoE forward would split
        # the step's one token along the sequence): by whether the EP group's rows agree.
        self._moe_steps_alone = {
            agree: all(getattr(layer.mlp, "steps_without_dispatcher", lambda _: False)(agree)
                       for layer in self.decoder.layers)
            for agree in (False, True)
        }
        self._adapted = adapted_linears(self)
        self._compiled_lean = None
        self._lean_dtypes: set[torch.dtype] = set()
        """The dtypes a lean decode step ran in (``decode_step``: the first one in a dtype runs eagerly)."""

    def set_input_tensor(self, input_tensor) -> None:
        """The previous pipeline stage's output (called by Megatron's schedules)."""
        if isinstance(input_tensor, list):
            assert len(input_tensor) == 1, "one model chunk per stage"
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        packed_seq_params: PackedSeqParams | None = None,
        return_hidden_states: bool = False,
        inference_context: InferenceCache | None = None,
        padding_mask: torch.Tensor | None = None,
        routing: RoutingTargets | None = None,
        **unused,
    ) -> torch.Tensor:
        """input_ids [b, s]; position_ids [b, s] (default 0..s-1, or per document when packed; the RoPE
        positions: the layers take the documents from packed_seq_params);
        attention_mask [b, s], True (1) for real tokens, None when all are (HF's meaning, not
        Megatron's [b, 1, s, s]); labels [b, s]; packed_seq_params: documents packed into batch 1
        (cu_seqlens_q), each attending only to itself; padding_mask [b, s] bool, True at padding
        (GPTModel's meaning): those tokens stay out of the MoE routers' load-balancing statistics
        (aux loss, z-loss, expert-bias counts). Right padding needs no attention_mask (attention is
        causal), but the aux loss pools over all tokens of the micro-batch.

        Returns on the last stage: logits [b, s, V/TP] (fp32 with fp32_lm_head), or with labels the
        cross-entropy [b, s], or with return_hidden_states the final-norm hidden states exactly as
        the output layer would take them, [s(/TP), b, H] (sequence first, this rank's slice under
        sequence parallelism), for a fused LM-head loss: parallel.vocab_parallel.lm_head_input
        maps them like ColumnParallelLinear maps its input, then lm_head_logprobs multiplies by
        this rank's vocab shard ``lm_head_weight``. Earlier stages return the hidden states
        [s(/TP), b, H] for the next stage. routing: the rollout's expert choices of this stage's
        layers, compared with the routers' own (``take_route_counts``) and replayed as it says
        (models/routing.py); None: the routers choose freely.

        Under context parallelism (CP > 1) a training forward (no inference_context) takes this CP
        rank's tokens of one packed row of N tokens: input_ids [1, N / CP] at
        ``zigzag_positions(N, CP, cp_rank)`` (N a multiple of 2 * CP, and of 2 * CP * TP under
        sequence parallelism), padding_mask, labels and routing sliced alike, and packed_seq_params
        with the GLOBAL cu_seqlens_q over all N positions (every CP rank the same). It returns what
        it returns without CP for those tokens: [1, N / CP, ...], or hidden states [N / CP(/TP), 1, H].
        Megatron's schedule multiplies a 2-tuple loss by CP and DDP averages over DP x CP, so each
        rank's loss is the sum over its own tokens (divided as the trainer normalizes).
        """
        seq_len = input_ids.shape[1]
        packed_seq_params = self._layer_packed_seq_params(input_ids, packed_seq_params, inference_context)
        if position_ids is None:
            position_ids = _default_positions(input_ids, packed_seq_params)
        if attention_mask is not None:
            attention_mask = attention_mask.bool()
        if padding_mask is not None:
            padding_mask = self._local_padding_mask(padding_mask, input_ids)
        self._set_routing(routing)
        hidden = self.embedding(input_ids=input_ids, position_ids=None) if self.pre_process else None
        cos = sin = None
        if self._has_softmax_layers:
            cos, sin = self.rotary(position_ids.expand(input_ids.shape[0], seq_len))
        hidden = self.decoder(
            hidden_states=hidden,
            attention_mask=attention_mask,
            rotary_pos_cos=cos,
            rotary_pos_sin=sin,
            packed_seq_params=packed_seq_params,
            inference_context=inference_context,
            padding_mask=padding_mask,
        )
        if not self.post_process or return_hidden_states:
            return hidden
        logits = self._logits(hidden)  # [s, b, V/TP]
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)

    def _layer_packed_seq_params(
        self, input_ids: torch.Tensor, packed_seq_params: PackedSeqParams | None, inference_context
    ) -> PackedSeqParams | None:
        """packed_seq_params as the layers take them: ``cp_group`` is the model's CP group when this
        forward splits the row over it (CP > 1, training: no inference_context), else None (decoding
        runs each CP rank's own sequences whole)."""
        splits = self._cp_group is not None and self._cp_group.size() > 1 and inference_context is None
        if splits and packed_seq_params is None:
            raise ValueError(
                f"context_parallel_size = {self._cp_group.size()}: a training forward takes this CP rank's zigzag "
                f"share of a packed row, so it needs packed_seq_params with the whole row's cu_seqlens_q; pack the "
                f"micro-batch (one row, its documents' offsets), or pass inference_context to decode without CP."
            )
        if splits and input_ids.shape[0] != 1:
            raise ValueError(
                f"context_parallel_size = {self._cp_group.size()}: input_ids has {input_ids.shape[0]} rows, but a "
                f"context-parallel forward takes one packed row, [1, tokens / CP]: concatenate the sequences."
            )
        group = self._cp_group if splits else None
        if packed_seq_params is None or packed_seq_params.cp_group is group:
            return packed_seq_params
        return dataclasses.replace(packed_seq_params, cp_group=group)

    def _local_padding_mask(self, padding_mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """padding_mask [b, s] -> the part of it this rank's MoE layers see: [b, s / TP], this rank's
        slice of the sequence, under sequence parallelism; [b, s] otherwise."""
        if padding_mask.shape != input_ids.shape or padding_mask.dtype != torch.bool:
            raise ValueError(
                f"padding_mask has shape {tuple(padding_mask.shape)} and dtype {padding_mask.dtype}: pass a bool "
                f"tensor of input_ids' shape {tuple(input_ids.shape)}, True at padding positions"
            )
        if not self.config.sequence_parallel:
            return padding_mask
        return tensor_parallel.scatter_to_sequence_parallel_region(
            padding_mask.T.contiguous(), group=self.pg_collection.tp
        ).T

    def _layer_routes(self) -> list[LayerRoutes]:
        return [layer.mlp.router.router_replay for layer in self.decoder.layers]

    def _set_routing(self, routing: RoutingTargets | None) -> None:
        """Each layer's targets for this forward, in its router's token order ([s(/TP), b] flattened)."""
        if routing is None:
            for routes in self._layer_routes():
                routes.set_targets(None, None, None, False)
            return
        layers = len(self.decoder.layers)
        if routing.experts.dim() != 4 or routing.experts.shape[2] != layers:
            raise ValueError(
                f"routing.experts has shape {tuple(routing.experts.shape)}: pass [b, S, {layers}, top-k], the "
                "rollout's experts of this pipeline stage's MoE layers"
            )
        sp_rank = self.pg_collection.tp.rank() if self.config.sequence_parallel else None
        tp_size = self.pg_collection.tp.size()
        experts = local_targets(routing.experts, sp_rank, tp_size).long()  # [T, L, k]
        recorded = local_targets(routing.recorded, sp_rank, tp_size)
        compare = None if routing.compare is None else local_targets(routing.compare, sp_rank, tp_size)
        for index, routes in enumerate(self._layer_routes()):
            routes.set_targets(experts[:, index], recorded, compare, routing.replay)

    def take_route_counts(self) -> torch.Tensor:
        """float64 [num_layers, 2]: per global layer, the compared tokens whose router chose other
        experts than the rollout and the tokens compared, since the last call (zeros for the layers
        of other pipeline stages; add over all ranks)."""
        device = self.decoder.layers[0].mlp.router.weight.device
        counts = torch.zeros(self.hybrid_config.num_layers, 2, dtype=torch.float64, device=device)
        for routes in self._layer_routes():
            taken = routes.take_counts()
            if taken is not None:
                counts[routes.layer_index] = taken
        return counts

    @contextlib.contextmanager
    def recording_routes(self) -> Iterator[None]:
        """Within it, each routing (prefill, decode step) keeps its experts for ``last_routes``."""
        routes = self._layer_routes()
        for layer_routes in routes:
            layer_routes.recording = True
        try:
            yield
        finally:
            for layer_routes in routes:
                layer_routes.recording, layer_routes.recorded = False, None

    def last_routes(self, batch: int, length: int) -> torch.Tensor:
        """[batch, length, L_stage, k] int64: the experts of the last forward's [batch, length] tokens
        in each MoE layer of this stage (``recording_routes``)."""
        recorded = [routes.recorded.view(length, batch, -1) for routes in self._layer_routes()]
        return torch.stack(recorded, dim=2).transpose(0, 1)

    @contextlib.contextmanager
    def generation_dtype(self, dtype: torch.dtype, keep: bool = False) -> Iterator[None]:
        """Run the model in ``dtype`` within the block (rollout.dtype): every parameter is replaced by a
        copy in ``dtype``, except those of modules that compute in fp32 as in training, whose copies
        are fp32 (not a bf16 weight cast at every step): the LM head's with fp32_lm_head, the MoE
        routers' with moe_router_dtype fp32 (Megatron's router_gating_linear); the
        parameters are put back on exit, untouched. float32 means at least fp32: an fp64 model (the
        tests' exact references) stays fp64. The weights a decode step multiplies together (each MoE
        layer's experts, a softmax layer's q / k / v: ``layers.StacksWeights``) are copied into one
        tensor each, with views of it in the parameters' places: a copy even when ``dtype`` is theirs.
        With ``keep`` (rollouts through the compiled decode step) the copies and stacks stay allocated
        after the block and the next one fills the same tensors in place (``layers.rollout_tensor``), so
        that the CUDA graphs recorded on their addresses replay in every rollout with the weights of the
        last optimizer step; without it they are freed on exit.

        A copy of the weights rather than autocast: the whole forward (residual stream, norms, KV
        cache, expert and router inputs) then runs in that precision as an inference engine does, not
        only autocast's matmuls, and the cast happens once per rollout (after the optimizer step that
        changed the weights). It costs the copy while generating (with ``keep``, from the first rollout
        on, training beside it): 2 bytes a parameter of this stage for bfloat16 beside fp32 weights,
        nothing but the stacks when ``dtype`` is the weights' own. The copies take the parameters' places in their modules; the
        Parameter objects themselves are not touched (changing a parameter's dtype in place would drop
        the gradient hooks Megatron's DDP put on it).

        FP8 (and FP4) is off within it: with precision.fp8 set, rollouts run in ``dtype`` on these
        weights (M1's choice: the prefill through Transformer Engine's GEMMs, the decode steps through
        the lean step's products), so no rollout depends on TE's divisibility rule for the token count
        (a decode step has as many tokens as running slots) or uses TE's FP8 weight cache, which only
        Megatron's schedule refreshes after an optimizer step.
        """
        computing_in_fp32 = set()
        if self.config.moe_router_dtype in ("fp32", "fp64"):
            computing_in_fp32.update(id(layer.mlp.router.weight) for layer in self.decoder.layers)
        if self.post_process and self.hybrid_config.fp32_lm_head:
            computing_in_fp32.add(id(self.output_layer.weight))

        def target(param: torch.Tensor) -> torch.dtype:
            if id(param) in computing_in_fp32:
                return torch.promote_types(param.dtype, torch.float32)
            return torch.promote_types(param.dtype, dtype) if dtype == torch.float32 else dtype

        self._forget_stacks()
        stacking = [module for module in self.modules() if isinstance(module, StacksWeights)]
        unused = {id(param) for module in stacking for param in module.stacked_parameters()}
        # The adapted linears' merged weights in their weights' places; a stack merges its own weights as it
        # copies them (layers.rollout_weight).
        swapped = self._merge_adapters(
            lambda linear, weight: rollout_tensor(linear, "weight", weight.shape, target(weight), weight.device),
            skip=unused,
        )
        unused.update(id(param) for linear in self._adapted for param in (linear.lora_A, linear.lora_B))
        cast = [
            (module, name, param)
            for module in self.modules()
            for name, param in module._parameters.items()
            if param is not None and id(param) not in unused and target(param) != param.dtype
        ]
        for module, name, param in cast:
            kept = rollout_tensor(module, name, param.shape, target(param), param.device)
            _replace_parameter(module, name, kept.copy_(param.detach()))
        swapped += cast
        for module in stacking:
            swapped += module.stacking_weights(target)
        quantized = [(config, config.fp8, config.fp4) for config in self._transformer_configs()]
        for config, _, _ in quantized:
            config.fp8 = config.fp4 = None
        try:
            yield
        finally:
            for config, fp8, fp4 in quantized:
                config.fp8, config.fp4 = fp8, fp4
            self._put_back(swapped)
            self._forget_stacks()
            if not keep:
                release_rollout_tensors(self)

    @contextlib.contextmanager
    def merged_adapters(self) -> Iterator[None]:
        """Within the block each adapted linear's weight is its merged weight ``W + s B A`` (in W's dtype) and
        its adapter is skipped: the weights that a rollout engine holding no adapters loads (vLLM's weight
        sync). The weights are put back on exit, untouched."""
        swapped = self._merge_adapters(lambda linear, weight: torch.empty_like(weight))
        try:
            yield
        finally:
            self._put_back(swapped)

    def _merge_adapters(self, destination, skip: set[int] = frozenset()
                        ) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter]]:
        """Mark every adapter merged, and put each adapted linear's merged weight in its weight's place (but
        for the weights whose ids ``skip`` holds), written into ``destination(linear, weight)`` (and cast to its
        dtype). Returns the (module, name, weight) replaced, to put back."""
        swapped = []
        for linear in self._adapted:
            linear.adapters_merged = True
            weight = linear.weight
            if id(weight) in skip:
                continue
            merged = destination(linear, weight)
            _replace_parameter(linear, "weight", merged.copy_(linear.merged_weight(merged.dtype)))
            swapped.append((linear, "weight", weight))
        return swapped

    def _put_back(self, swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]]) -> None:
        """Undo the replacements ``swapped`` lists, the last first (a merged weight that a stack replaced goes
        back before the weight it replaced), and unmark the adapters."""
        for module, name, param in reversed(swapped):
            module._parameters[name] = param
        for linear in self._adapted:
            linear.adapters_merged = False

    def _transformer_configs(self) -> list[TransformerConfig]:
        """The distinct TransformerConfig objects of the model's modules (Megatron reads flags from them)."""
        configs = {
            id(m.config): m.config for m in self.modules() if isinstance(getattr(m, "config", None), TransformerConfig)
        }
        return list(configs.values())

    def _forget_stacks(self) -> None:
        for module in self.modules():
            if isinstance(module, StacksWeights):
                module.forget_stacks()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """This rank's vocab shard of the LM head, [V/TP, H]."""
        return self.output_layer.weight

    def _logits(self, hidden: torch.Tensor, *, plain: bool = False) -> torch.Tensor:
        """[s(/TP), b, H] -> [s, b, V/TP]; with fp32_lm_head the matmul and the logits are fp32 (the
        bf16 weight is upcast; its gradient flows back through the cast). plain: a local matmul
        instead of the ColumnParallelLinear (the lean decode step, TP = 1), any [..., H] input."""
        weight = self.output_layer.weight
        if self.hybrid_config.fp32_lm_head:
            hidden, weight = at_least_fp32(hidden), at_least_fp32(weight)
        if plain:
            return F.linear(hidden, weight)
        logits, _ = self.output_layer(hidden, weight=weight)
        return logits

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> ShardedStateDict:
        """Checkpoint keys name each layer by its global number (``decoder.layers.N.``): lightning and
        softmax layers hold different parameters, so they cannot be stacked along a layer axis.
        The same keys at any TP / PP / EP layout let checkpoints reshard."""
        metadata = {**(metadata or {}), "non_homogeneous_layers": True}
        return super().sharded_state_dict(prefix, sharded_offsets, metadata)

    # ------------------------------------------------------------------------------------------
    # Decoding

    @torch.no_grad()
    def prefill(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, return_all_logits: bool = False
    ) -> tuple[torch.Tensor, InferenceCache]:
        """Run left-padded prompts and build the decoding cache.

        input_ids [b, s]; attention_mask [b, s], 1 for real tokens, 0 for the left padding (None:
        no padding). Returns (logits, cache): the full-vocabulary logits fp32 of the last position
        [b, V] (the LM head runs on that position only), or of every position [b, s, V] with
        return_all_logits (pad positions hold junk).
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        attention_mask = attention_mask.bool()
        _check_left_padded(attention_mask)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        cache = InferenceCache(valid_mask=attention_mask, next_positions=attention_mask.long().sum(-1))
        logits = self._decode_forward(input_ids, position_ids, attention_mask, cache, last_only=not return_all_logits)
        return (logits if return_all_logits else logits[:, -1]), cache

    @torch.no_grad()
    def decode_step(
        self, token_ids: torch.Tensor, cache: InferenceCache, *, compiled: bool = False
    ) -> tuple[torch.Tensor, InferenceCache]:
        """Append one token per sequence (token_ids [b] or [b, 1]); returns (logits [b, V] fp32, cache),
        the cache advanced in place. ``compiled`` runs the lean step through torch.compile (where
        ``compiled_decode_supported``; the model's first lean step in a dtype runs eagerly): the first
        steps of a batch size compile its graph."""
        token_ids = token_ids.reshape(cache.batch_size, 1)
        position_ids = cache.next_positions[:, None]
        if not self._lean_step_applies(cache):
            cache.append_token()
            logits = self._decode_forward(token_ids, position_ids, None, cache, last_only=True)
            cache.advance_positions()
            return logits[:, -1], cache
        # EP ranks whose rows differ step their MoE layers through Megatron's dispatcher: eagerly.
        compiled = compiled and self._moe_steps_alone[cache.rows_agree]
        # A model's first lean step in a dtype (the residual stream's) runs eagerly, compiled or not: what
        # its modules compute on first use and keep (the lightning layers' decay factors) is then made
        # outside any graph. Made in a graph, it would be one of the graph's outputs, which the next
        # compiled call frees on CUDA (a new cudagraph-tree generation), and later steps would read it.
        dtype = next(self.decoder.parameters()).dtype
        compiled = compiled and dtype in self._lean_dtypes
        self._lean_dtypes.add(dtype)
        # This token and, compiled, one more (InferenceCache.reserve): the step never grows a buffer.
        cache.reserve(2 if compiled else 1)
        if compiled:
            cache.mark_dynamic_shapes(token_ids)
            cache.mark_static_addresses()
        span = cache.step_span(bucketed=compiled)
        logits = self._decode_forward(token_ids, position_ids, None, cache, last_only=True, lean_span=span,
                                      compiled=compiled)
        cache.count_step()
        return logits[:, -1], cache

    @torch.no_grad()
    def extend(self, cache: InferenceCache, row: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Feed ``token_ids`` [k] to the sequence of ``row`` ([1] int64) of ``cache`` after its last token,
        from its cached state: a multi-turn rollout's environment reply, prefilled with nothing before it
        recomputed. The row's sequence is rewritten to end at the cache's newest position, so its oldest
        k positions must be masked (``InferenceCache.pad_front`` makes room). Returns the full-vocabulary
        fp32 logits [1, V] of its last token; a prefill's routes are recorded (``last_routes(1, k)``)."""
        length = token_ids.numel()
        extended = cache.select(row)
        extended.append_positions(length)
        position_ids = extended.next_positions[:, None] + torch.arange(length, device=token_ids.device)
        attention_mask = torch.ones((1, length), dtype=torch.bool, device=token_ids.device)
        logits = self._decode_forward(token_ids.view(1, length), position_ids, attention_mask, extended, last_only=True)
        extended.next_positions = extended.next_positions + length
        cache.write_rows(row, extended.newest(cache.length))
        return logits[:, -1]

    def _decode_forward(
        self, input_ids, position_ids, attention_mask, cache: InferenceCache, *, last_only: bool,
        lean_span: int | None = None, compiled: bool = False,
    ) -> torch.Tensor:
        """Full-vocabulary fp32 logits [b, s, V], or [b, 1, V] of the last position with last_only,
        on every rank (every pipeline stage too: each draws the same next token).

        last_only runs the LM head on the last position alone: a prompt's other positions would
        cost a [s, H] x [H, V/TP] matmul and a [b, s, V] gather only to be dropped. With sequence
        parallelism off every rank holds the whole sequence, so the last position is local.

        Under pipeline parallelism the stages run one after the other: each receives the previous
        stage's hidden states [s, b, H], runs its layers against its part of the cache and sends
        its output on; the last stage's logits are then broadcast to all stages.

        A decode step on the lean path (``lean_span``: one token appended to a filled cache, its
        attention reading that many positions; ``decode_step`` decides where it applies) calls the same
        modules and weights through their ``step`` methods; with ``compiled``, through torch.compile
        of that path.
        """
        pp_group = self.pg_collection.pp
        pp_rank = torch.distributed.get_rank(pp_group)
        batch, length = input_ids.shape
        received = None
        if not self.pre_process:
            like = next(self.decoder.parameters())
            received = torch.empty(length, batch, self.config.hidden_size, dtype=like.dtype, device=like.device)
            torch.distributed.recv(received, src=torch.distributed.get_global_rank(pp_group, pp_rank - 1), group=pp_group)
        if lean_span is not None and compiled:
            # On CUDA a compiled call's outputs live until the next compiled call (the rollout's draw)
            # starts a new cudagraph-tree generation, which frees them (pytorch#175557): the caller gets
            # a copy of the logits, [b, V] fp32 (rows x V x 4 bytes). What the next step reads stays in
            # the cache's own tensors, written in place (static addresses), none of it an output.
            compiled_stage = self._compiled_lean_stage()
            hidden, logits = compiled_stage(input_ids[:, 0], position_ids, cache, received, lean_span)
            logits = logits.clone()
        elif lean_span is not None:
            hidden, logits = self._lean_stage(input_ids[:, 0], position_ids, cache, received, lean_span)
        else:
            hidden, logits = self._megatron_stage(input_ids, position_ids, attention_mask, cache, received, last_only)
        if not self.post_process:
            next_stage = torch.distributed.get_global_rank(pp_group, pp_rank + 1)
            torch.distributed.send(hidden.contiguous(), dst=next_stage, group=pp_group)
            logits = torch.empty(
                batch, 1 if last_only else length, self.vocab_size, dtype=torch.float32, device=input_ids.device
            )
        return broadcast_from_last_stage(logits, pp_group)

    def _megatron_stage(
        self, input_ids, position_ids, attention_mask, cache: InferenceCache, received: torch.Tensor | None,
        last_only: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's forward through Megatron's modules: (hidden states [s, b, H], and on the last
        stage the full-vocabulary fp32 logits [b, s or 1, V], else None)."""
        if received is not None:
            self.set_input_tensor(received)
        with self._sequence_parallel_off():
            hidden = self.forward(
                input_ids, position_ids, attention_mask, inference_context=cache, return_hidden_states=True
            )  # [s, b, H]
            if not self.post_process:
                return hidden, None
            if last_only:
                hidden = hidden[-1:]
            logits = self._logits(hidden).transpose(0, 1).contiguous()  # [b, s or 1, V/TP]
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits, group=self.pg_collection.tp)
        return hidden, at_least_fp32(logits).contiguous()

    def _lean_stage(
        self, token_ids: torch.Tensor, position_ids: torch.Tensor, cache: InferenceCache, received: torch.Tensor | None,
        span: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This stage's part of a one-token decode step on the lean path: token_ids [b] (first stage)
        or the previous stage's output ``received`` [1, b, H]; position_ids [b, 1]; the softmax layers
        attend over ``span`` positions (``InferenceCache.step_span``). Returns (hidden states [1, b, H],
        and on the last stage the fp32 logits [b, 1, V], else None): what _megatron_stage computes,
        through each module's ``step``. The embedding is a row lookup (no position embedding;
        no dropout in eval mode). The step's position is written and the cache advanced in place, at
        ``cache.column`` on the device: the shapes depend on the rows and the span alone."""
        if self.pre_process:
            hidden = self._embed_step(token_ids)  # [b, H]
        else:
            hidden = received[0]
        cache.open_step()
        attention = None
        if self._has_softmax_layers:
            attention = AttentionStep.build(self.rotary, position_ids, self.hybrid_config.head_dim, cache, hidden.dtype,
                                            span)
        for layer in self.decoder.layers:
            hidden = layer.step(hidden, cache, attention)
        cache.close_step()
        if not self.post_process:
            return hidden[None], None
        hidden = self.decoder.final_layernorm.step(hidden)
        logits = at_least_fp32(self._logits(hidden, plain=True))  # [b, V/TP]
        if self._tp_size > 1:
            logits = all_gather_columns(logits, self.pg_collection.tp)  # [b, V]
        return hidden[None], logits[:, None]

    def _embed_step(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [b] -> [b, H]: VocabParallelEmbedding's lookup (no dropout in eval mode), its
        out-of-shard ids masked with masked_fill rather than a boolean index (a host sync on a GPU)."""
        embedding = self.embedding.word_embeddings
        if self._tp_size == 1:
            return F.embedding(token_ids, embedding.weight)
        local_ids = token_ids - embedding.vocab_start_index
        outside = (token_ids < embedding.vocab_start_index) | (token_ids >= embedding.vocab_end_index)
        hidden = F.embedding(local_ids.masked_fill(outside, 0), embedding.weight).masked_fill(outside[:, None], 0.0)
        return tensor_parallel.reduce_from_tensor_model_parallel_region(hidden, group=self.pg_collection.tp)

    @property
    def compiled_decode_supported(self) -> bool:
        """Whether ``decode_step(compiled=True)`` can trace the lean step as one graph: the lean path
        applies to the layout, one stage holds every layer, and every MoE layer
        steps without Megatron's dispatcher when its EP group's rows agree (as a rollout's lockstep
        keeps them). The step's collectives (TP's sums and gathers, EP's gather and reduce-scatter) are
        nodes of the graph; a step whose EP rows differ runs Megatron's modules, eagerly."""
        return (
            self._lean_step_supported
            and self.pg_collection.pp.size() == 1
            and self._moe_steps_alone[True]
        )

    def _compiled_lean_stage(self):
        """``_lean_stage`` through torch.compile, built on the first compiled step. Batch 1 and larger
        batches get a graph each (the batch size, the buffers' capacity and the span are dynamic in it
        from the first compile, ``dynamic=True``: a static graph first, then a dynamic one, would cost
        two of the code's torch._dynamo.config.recompile_limit = 8 graphs; a rollout of many shapes
        compiles 3 with inductor, tests/slow/test_decode_catalog.py). On CUDA the graph runs as CUDA graphs
        (inductor's cudagraph trees), one recorded per shape: the span is bucketed and the rollout's
        rows are too (megacispo.rollout.generate), so a rollout records a few, each replayed at every
        step of its bucket; the cache's buffers are marked as static addresses (mutated in place), and
        so are the rollout's weights (``generation_dtype``: the same tensors every rollout).

        The function compiled is this model's own copy of the method (``_own_code``): dynamo keeps its
        compiled graphs on the code object, and the step's guards leave the modules out
        (``_lean_step_guards``), so a graph compiled for another model of the same architecture would
        pass them and run on this one (with that model's Python attributes, as a crash or its numbers)."""
        if not self.compiled_decode_supported:
            raise ValueError(
                "decode_step(compiled=True) (rollout.compile_decode) needs the lean decode step on one pipeline "
                "stage: pipeline parallel size 1 and MoE layers of SwiGLU experts with a plain top-k router; set "
                "rollout.compile_decode=false for this layout"
            )
        if self._compiled_lean is None:
            self._compiled_lean = torch.compile(_own_code(self._lean_stage), dynamic=True,
                                                options=lean_compile_options(self.lm_head_weight.device))
        return self._compiled_lean

    def _lean_step_applies(self, cache: InferenceCache) -> bool:
        """Whether a one-token decode step on ``cache`` can skip Megatron's TransformerBlock, parallel
        linears and router: the layout allows it (``_lean_step_supported``; under TP, with the MoE
        layers' dispatch-free step for the cache's rows), ``lean_decode`` is on, the GEMMs are not FP8 /
        FP4 (within generation_dtype they never are), every adapter is merged into its weight (within
        generation_dtype), and nothing is recorded for autograd or depends on training mode (dropout,
        router noise)."""
        return (
            self._lean_step_supported
            and all(linear.adapters_merged for linear in self._adapted)
            and (self._tp_size == 1 or self._moe_steps_alone[cache.rows_agree])
            and self.lean_decode
            and not (self.config.fp8 or self.config.fp4)
            and not self.training
            and not torch.is_grad_enabled()
        )

    @contextlib.contextmanager
    def _sequence_parallel_off(self) -> Iterator[None]:
        """Run a model built with sequence parallelism as a plain TP model (same weights, every rank
        holds the whole sequence): one new token cannot be split along the sequence. Megatron reads
        the flag from the shared TransformerConfig, and the linears and the embedding copy it at
        construction; all are switched off and back on (GPTModel's inference path switches its
        output layer's flag the same way). Forward only: the backward of these modules would differ.
        """
        if not self.config.sequence_parallel:
            yield
            return
        switches = [
            (owner, name)
            for owner in (*self.modules(), *self._transformer_configs())
            for name in ("sequence_parallel", "reduce_scatter_embeddings")
            if getattr(owner, name, None) is True
        ]
        for owner, name in switches:
            setattr(owner, name, False)
        try:
            yield
        finally:
            for owner, name in switches:
                setattr(owner, name, True)


def _replace_parameter(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Put ``tensor`` in the place of ``module``'s parameter ``name`` as a frozen Parameter with the
    replaced one's attributes (Megatron's: tensor_model_parallel, allreduce, ...)."""
    copy = torch.nn.Parameter(tensor, requires_grad=False)
    copy.__dict__.update(module._parameters[name].__dict__)
    module._parameters[name] = copy


def _default_positions(input_ids: torch.Tensor, packed_seq_params: PackedSeqParams | None) -> torch.Tensor:
    """[1, s]: 0..s-1, restarting at each packed document; under context parallelism
    (packed_seq_params.cp_group set) those of this CP rank's zigzag tokens of the whole row."""
    seq_len = input_ids.shape[1]
    if packed_seq_params is None:
        return torch.arange(seq_len, device=input_ids.device)[None]
    group = packed_seq_params.cp_group
    if group is None:
        positions = torch.arange(seq_len, device=input_ids.device)
    else:
        positions = zigzag_positions(seq_len * group.size(), group.size(), group.rank(), device=input_ids.device)
    return positions_in_documents(packed_seq_params.cu_seqlens_q, positions)[None]


def _own_code(method: types.MethodType) -> types.MethodType:
    """``method`` bound to its object through a ``code_copy`` of its function: the object's graphs alone."""
    return types.MethodType(code_copy(method.__func__), method.__self__)


def _check_left_padded(attention_mask: torch.Tensor) -> None:
    if attention_mask.shape[1] and bool((attention_mask[:, 1:].long() < attention_mask[:, :-1].long()).any()):
        raise ValueError(
            "attention_mask must be left-padded (each row zeros, then ones): a pad after a real token "
            "would decay the lightning-attention state. Pad prompts on the left."
        )
    if not bool(attention_mask.any(dim=1).all()):
        raise ValueError("attention_mask has a row without real tokens: every prompt needs at least one token.")


def lean_compile_options(device: torch.device) -> dict:
    """torch.compile's options for the lean decode step on ``device``: on CUDA its graphs run as CUDA
    graphs (inductor's cudagraph trees, what mode="reduce-overhead" sets)."""
    options = {"guard_filter_fn": _lean_step_guards}
    if device.type == "cuda":
        options["triton.cudagraphs"] = True
    return options


def _lean_step_guards(guards) -> list[bool]:
    """Which of dynamo's guards the compiled lean step checks before each call (guard_filter_fn).

    Kept: every guard on the step's inputs (the cache's tensors, dict keys and lengths; the tokens)
    and on global state; of those on the model's modules, the guards on the values of their Python
    attributes (config numbers and flags, which the graph holds as constants), and one parameter's
    tensor guard (its dtype, device and shape: a model cast or moved as a whole compiles anew).
    Dropped: the other guards on modules and parameters (types, dict keys, each parameter's tensor
    checks), about 1 ms a step on a CPU, 4x all the rest; a model's module tree and parameter
    shapes do not change once it is built."""
    keep, tensor_kept = [], False
    for guard in guards:
        on_module = guard.orig_guard.source.is_unspecialized_nn_module()
        kept = not on_module or guard.guard_type in ("CONSTANT_MATCH", "EQUALS_MATCH")
        if on_module and guard.guard_type == "TENSOR_MATCH" and not tensor_kept:
            kept = tensor_kept = True
        keep.append(kept)
    return keep
