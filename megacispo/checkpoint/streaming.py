"""What both directions of the checkpoint converter share: the meter of the bytes it holds, tensor
sizes, torch.distributed.checkpoint in one process, and the rule that it never overwrites."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from pathlib import Path
from typing import Iterator

import torch


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
