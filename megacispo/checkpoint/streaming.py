"""What both directions of the checkpoint converter share: the meter of the bytes it holds, tensor
sizes, torch.distributed.checkpoint in one process, the rule that it never overwrites, and the
check that every weight read from a checkpoint is finite (``check_finite``, which every load of
weights calls: converting, training, evaluating and scoring)."""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from pathlib import Path
from typing import Iterator

import torch

from megacispo.checkpoint.formats import CheckpointError

# check_finite looks at this many elements at a time: its temporary stays 16 MiB whatever the tensor.
FINITE_CHECK_ELEMENTS = 1 << 24


class TensorMeter:
    """Bytes of the tensors the converter holds at once: every tensor it reads or makes is tracked
    until the last reference to it is gone (weakref finalizers), whoever keeps it (the writers
    too); tensors that share memory (views) count once."""

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest_bytes = 0
        self._holders: dict[int, list[int]] = {}
        """storage address -> [number of live tracked tensors on it, its bytes]"""

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        address, nbytes = storage.data_ptr(), storage.nbytes()
        holders = self._holders.setdefault(address, [0, nbytes])
        if holders[0] == 0:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.largest_bytes = max(self.largest_bytes, nbytes)
        holders[0] += 1
        weakref.finalize(tensor, self._release, address)
        return tensor

    def _release(self, address: int) -> None:
        holders = self._holders[address]
        holders[0] -= 1
        if holders[0] == 0:
            self.live_bytes -= holders[1]
            del self._holders[address]


@contextlib.contextmanager
def single_process_dcp() -> Iterator[None]:
    """torch.distributed.checkpoint with no_dist=True warns that it assumes one process: meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        yield


def nbytes(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel * dtype.itemsize


def check_new(out: Path) -> None:
    if out.exists():
        raise ValueError(f"--out {out} already exists: choose a new directory (the converter never overwrites).")


def check_finite(name: str, tensor: torch.Tensor, source: str | os.PathLike) -> None:
    """CheckpointError naming the tensor ``name`` and the file ``source`` it was read from when
    ``tensor`` holds a NaN or an infinity: a model with one computes NaN everywhere downstream, and
    nothing else would notice before the metrics (or an optimizer assertion) turn meaningless."""
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), FINITE_CHECK_ELEMENTS):
        if bool(torch.isfinite(flat[start : start + FINITE_CHECK_ELEMENTS]).all()):
            continue
        bad = ~torch.isfinite(tensor)
        index = bad.nonzero()[0].tolist()
        first = tensor[tuple(index)].item()
        raise CheckpointError(
            f"tensor {name} in {source} is not finite: NaN or inf in {int(bad.sum())} of its {flat.numel()} values "
            f"(the first, {first}, at index {index}): the weights are damaged; use an intact copy "
            f"of the checkpoint (download or export it again)."
        )
