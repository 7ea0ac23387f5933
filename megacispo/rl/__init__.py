"""The RL recipe: its config section, the policy losses, advantages, rollout correction, adaptive
clipping, metric hooks, the trainer (the RL loop), where a run starts and the run itself."""
