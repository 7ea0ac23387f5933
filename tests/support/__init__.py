"""What the tests and the benchmarks share, installed as ``megacispo.testing`` (setup.py maps it to
tests/support; import it, never put tests/ on sys.path). Production code never imports it.

- harness: run a function in N real processes as torchrun would (``run_distributed``);
- parallel_case: the parallel-equivalence case (one forward-backward, comparison by key);
- device_guard: host memory as a second device on a CPU-only machine (the device tier);
- checkpoints: whole-model views of a checkpoint (``load_single_process``, ``full_tensors``);
- hf_models: the tiny random transformers MiniMax model, its log-probs, conversion and scoring;
- rl_runs: the small end-to-end RL runs (overrides, megacispo.train in a worker, SIGTERM under torchrun);
- layout_matrix, bad_inputs, loss_comparison, gpu_check_twin, saved_activations: what a test file
  and its slow-tier counterpart share;
- reward_fixtures, fault_rewards: reward functions a run loads as ``megacispo.testing.<module>:<name>``;
- tool_modules: the loader of tools/ scripts (``load_tool``);
- triton_modules: private copies of a Triton kernels' module, interpreted on the CPU (``load_kernels_module``).

The fixtures built on these are in tests/conftest.py.
"""
