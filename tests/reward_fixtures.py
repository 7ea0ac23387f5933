"""Reward functions for the end-to-end tests (loaded by the trainer as ``reward_fixtures:name``)."""


def odd_length(response: str, record) -> float:
    """A reward an untrained model earns about half the time, so groups have spread and the loss acts."""
    return float(len(response) % 2)
