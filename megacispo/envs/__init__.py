"""Environments that answer the model between its turns: multi-turn, tool-using rollouts."""
