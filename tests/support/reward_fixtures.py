"""Reward functions for the end-to-end tests and benchmarks/gpu_check.py (loaded by the trainer as
``megacispo.testing.reward_fixtures:name``)."""


def odd_length(response: str, record) -> float:
    """A reward an untrained model earns about half the time, so groups have spread and the loss acts."""
    return float(len(response) % 2)


def code_point_parity(response: str, record) -> float:
    """A reward the tiny random model earns about half the time, so that every metric has spread."""
    return float(sum(map(ord, response)) % 2)
