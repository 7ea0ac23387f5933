"""megacispo: CISPO reinforcement learning for hybrid lightning-attention MoE models on Megatron-Core.

Entry points: train (RL), sft (the supervised warm start), eval (held-out accuracy, pass@k), score
(per-token log-probs). config assembles the run config from the subsystems' sections; startup checks
it as a whole before anything is built. Subsystems: data, rollout, rl, training, evaluation, metrics,
checkpoint; models and parallel hold the model and its parallel layout."""
