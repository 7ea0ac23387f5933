"""megacispo.rollout.vllm_install refuses, in one line that says how to install a supported one, a vLLM that
is not there (this environment has none: vLLM lives in .venv-vllm) or whose release it is not tested with."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

from megacispo.rollout import vllm_install


def test_without_vllm_the_error_says_how_to_install_it():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    with pytest.raises(ValueError, match=r"^vLLM is not installed: pip install 'megacispo\[vllm\]' on GPUs; on a "
                                         r"CPU, bash tools/setup_env.sh --vllm"):
        vllm_install.vllm_version()


@pytest.mark.parametrize("version, supported", [("0.31.2", False), ("0.32.0", True), ("0.33.1+cu129", True),
                                                ("0.34.0", False), ("1.0.0", False)])
def test_a_release_outside_the_tested_range_is_refused_naming_it(monkeypatch, version, supported):
    monkeypatch.setattr(vllm_install.importlib.metadata, "version", lambda distribution: version)
    if supported:
        assert vllm_install.vllm_version() == version
    else:
        with pytest.raises(ValueError, match=rf"^vLLM {version} is installed: megacispo's vLLM rollouts are tested "
                                             r"with 0.32 <= vLLM < 0.34; pip install"):
            vllm_install.vllm_version()
