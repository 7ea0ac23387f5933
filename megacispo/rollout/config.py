"""The rollout sections: generation (``rollout:``) and which processes generate (``placement:``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megacispo.fields import AT_LEAST_1, FRACTION, POSITIVE, Range, check_choice, check_ranges, ranged

# rollout.dtype's choices: the precisions a rollout can generate in, or auto (by device).
ROLLOUT_DTYPES = ("auto", "float32", "bfloat16")
# rollout.engine's choices: megacispo's own engine (megacispo.rollout.generate), or vLLM in every training
# process (megacispo.rollout.vllm_engine; the families vLLM serves).
MEGACISPO, VLLM = "megacispo", "vllm"
ROLLOUT_ENGINES = (MEGACISPO, VLLM)


@dataclass(kw_only=True)
class RolloutConfig:
    """Generation of G samples per prompt by the policy being trained."""

    prompts_per_step: int = ranged(8, AT_LEAST_1)
    """Prompt groups in one rollout batch (after dynamic sampling)."""
    group_size: int = ranged(8, Range(2, note="group-relative advantages need at least 2 samples per prompt"))
    """G: samples per prompt; advantages are relative within a group."""
    max_new_tokens: int = ranged(16, AT_LEAST_1)
    """Generation stops after this many tokens."""
    temperature: float = ranged(1.0, Range(0, note="0: greedy"))
    """Sampling temperature; 0 means greedy."""
    top_p: float = ranged(1.0, Range(0, 1, low_open=True))
    """Nucleus sampling: keep the smallest token set with this much probability."""
    top_k: int = ranged(0, Range(0, note="0: off"))
    """Keep only the k most likely tokens (0: off)."""
    early_truncation_tokens: int = ranged(0, Range(0, note="0: off"))
    """Stop a sample after this many consecutive tokens each above early_truncation_prob (0: off; M1 used 3000)."""
    early_truncation_prob: float = ranged(0.99, FRACTION)
    """The probability threshold of early truncation."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal and sample more until the batch is full."""
    max_sampling_rounds: int = ranged(4, AT_LEAST_1)
    """Cap on rollout rounds spent filling one batch under dynamic sampling."""
    compile_decode: bool = False
    """Run each decode step and draw through torch.compile, as CUDA graphs on GPUs (PP = 1; TP and EP collectives inside the graph); the first steps compile."""
    max_running: int = ranged(0, Range(0, note="0: all of a rank's samples at once"))
    """Sequences decoded together per rank; a finished one's slot takes the next waiting sample (0: all at once)."""
    host_check_every: int = ranged(0, Range(0, note="0: auto"))
    """Decode steps between the host's looks at which samples ended (a device-to-host copy each; an ended slot idles until then), at most max_new_tokens; 0: 4 on GPUs, 1 on a CPU."""
    max_cache_gib: float = ranged(0.0, Range(0, note="0: no cap"))
    """Cap on the rollout cache of max_running slots per GPU, GiB, checked at start-up (0: no cap)."""
    dtype: str = "auto"
    """Precision of generation: auto (bfloat16 on GPUs, float32 on a CPU), float32 or bfloat16 (the LM head follows model.fp32_lm_head)."""
    max_staleness: int = ranged(0, Range(0, note="0: synchronous"))
    """Steps a rollout's weights may lag the step it trains (needs placement.rollout_ranks; 0: on-policy, 1: one step behind)."""
    engine: str = MEGACISPO
    """What generates: megacispo (its own engine) or vllm (vLLM in every training process; MiniMax-M2 only)."""
    vllm_tensor_parallel: int = ranged(1, AT_LEAST_1)
    """engine=vllm: consecutive training processes that share one vLLM engine, its weights split over them (a divisor of the world size)."""
    vllm_cache_gib: float = ranged(1.0, POSITIVE)
    """engine=vllm: vLLM's paged K/V cache per process, GiB (taken beside training's memory)."""
    vllm_sync_tolerance: float = ranged(0.0, Range(0, note="0: auto"))
    """engine=vllm: the largest |log-prob difference| of the probe after a weight sync (0: auto, 1e-2 in float32, 0.1 in bfloat16)."""

    def check(self) -> None:
        check_ranges(self, "rollout")
        check_choice("rollout.dtype", self.dtype, ROLLOUT_DTYPES)
        check_choice("rollout.engine", self.engine, ROLLOUT_ENGINES)

    def steps_between_looks(self, on_gpu: bool) -> int:
        """rollout.host_check_every for a rollout on a GPU or not. auto is 4 on a GPU, where a look waits
        for the device to finish the step, and 1 on a CPU, where the host is the device and a look costs
        nothing, so an ended slot is refilled at once. At most max_new_tokens: every sample has ended by
        then, and the ranks of a lockstep group (which look at these steps only) would step idle rows
        until the look (host_check_every = 1000 with max_new_tokens = 6: 3999 steps for 23)."""
        every = (4 if on_gpu else 1) if self.host_check_every == 0 else self.host_check_every
        return min(every, self.max_new_tokens)

    def torch_dtype(self, on_gpu: bool) -> torch.dtype:
        """rollout.dtype as a torch dtype for a rollout on a GPU or not. auto is bfloat16 on a GPU, as M1
        generated (with the fp32 LM head), and float32 on a CPU: a CPU has no fast bf16 products, and the
        quick start's accuracy was measured with fp32 rollouts."""
        if self.dtype == "auto":
            return torch.bfloat16 if on_gpu else torch.float32
        return getattr(torch, self.dtype)

    def sync_tolerance(self, on_gpu: bool) -> float:
        """rollout.vllm_sync_tolerance for a rollout on a GPU or not: auto is 1e-2 when both engines compute in
        float32, 0.1 in bfloat16. The probe's random tokens are unlikely ones, whose log-probs the two engines'
        float32 kernels put up to 3.4e-4 apart on the M2 quick start's model; bfloat16 rounding moves them by
        a few hundredths. A tensor not sent or loaded into the wrong place moves some by far more (0.5-2
        measured)."""
        if self.vllm_sync_tolerance:
            return self.vllm_sync_tolerance
        return 1e-2 if self.torch_dtype(on_gpu) == torch.float32 else 0.1


@dataclass(kw_only=True)
class PlacementConfig:
    """Which processes generate and which train."""

    rollout_ranks: int = ranged(0, Range(0, note="0: every process generates and trains"))
    """K: the last K processes only generate (whole-model replicas: TP = PP = EP = 1), the others only train (0: all do both)."""
    liveness_timeout_s: float = ranged(20.0, POSITIVE)
    """Seconds a training or rollout process may send no heartbeat before the other side stops the run, naming it (with rollout_ranks)."""

    def check(self) -> None:
        check_ranges(self, "placement")
