"""CUDA tensors without a GPU, for running the code's CUDA branches on a CPU.

Under torch's FakeTensorMode a tensor made on ``cuda`` says ``is_cuda`` and carries a shape, a dtype
and strides but no data, and each op runs its shape function (its meta kernel, or a custom op's fake
implementation) instead of a kernel: the shape functions take the same arguments as the CUDA kernels
and check them, so a wrong argument order, dtype or shape fails here as it would on a GPU. What reads
a tensor's values on the host (``.item()``, ``.tolist()``, ``bool(tensor)``) raises, as a host sync
should not happen on those paths anyway.

One mode serves the process: code caches device tensors by device (models/lightning_triton.py's
block tables), and a fake tensor meets only tensors of its own mode.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from torch._subclasses.fake_tensor import FakeTensorMode


@functools.cache
def _mode() -> FakeTensorMode:
    return FakeTensorMode()


@contextlib.contextmanager
def fake_cuda() -> Iterator[None]:
    """Within it, tensors made on ``cuda`` are fake CUDA tensors and ops on them run shape functions."""
    with _mode():
        yield
