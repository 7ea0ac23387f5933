"""Right padding, the one way sequences of different lengths share a batch: rows padded at the end
along the sequence axis, and the mask that marks the padding for the model."""

from __future__ import annotations

import torch


def pad_right(values: torch.Tensor, width: int, value: float | int = 0) -> torch.Tensor:
    """[n, S, ...] -> [n, width, ...], ``value`` after S."""
    padding = values.new_full((values.shape[0], width - values.shape[1], *values.shape[2:]), value)
    return torch.cat([values, padding], dim=1)


def right_padding_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[n, width] bool, True at the padding of sequences of ``lengths`` [n] right-padded to ``width``
    (the model's ``padding_mask``)."""
    return torch.arange(width, device=lengths.device) >= lengths[:, None]
