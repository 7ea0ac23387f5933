"""What a checkpoint may unpickle: a checkpoint is someone else's file, and unpickling it must run no code.

A torch_dist checkpoint holds three kinds of pickles:

- ``.metadata``, torch DCP's index of the shards: read by ``read_dcp_metadata`` with an unpickler
  that knows only DCP's metadata classes, ``torch.Size``, the dtypes and the layouts
  (METADATA_GLOBALS); torch's own reader unpickles it with full pickle.
- the byte records inside the ``__*.distcp`` shards (each module's ``_extra_state``): read by
  ``load_weights_only``, torch's weights-only unpickler (tensors and containers) with
  BYTE_RECORD_GLOBALS added; torch DCP's planner reads them with full pickle. Transformer
  Engine's FP8 state is such a record, a uint8 tensor that TE's ``set_extra_state`` unpickles with
  full pickle once the weights are loaded: ``check_extra_state`` first reads it as TRANSFORMER_ENGINE
  allows (tensors, containers, TE's recipe dataclasses and enums), storages included.
- common.pt and rng/rank_*.pt (torch.save archives): read with ``load_weights_only`` too.

Anything else refuses with ``RefusedPickle``, naming the global it would have called; nothing of the
pickle runs. ``CheckpointReader`` is torch DCP's file reader with this index reader, used by every
load (megacispo.checkpoint.dcp_load) and by the converter (megacispo.checkpoint.to_hf).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import io
import os
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DTYPES = frozenset(name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype))
# The classes and functions torch DCP's .metadata refers to (torch 2.13), and the two classes
# Megatron-Core declares so that older checkpoints' indexes unpickle.
METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch": frozenset({"Size", *_DTYPES}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    }),
    "torch.distributed.checkpoint.planner": frozenset({"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "megatron.core.dist_checkpointing.strategies.torch": frozenset({"MCoreMetadata", "MCoreSavePlan"}),
}
# Beyond tensors and containers: a byte record that Transformer Engine's older releases wrote as a
# BytesIO (their set_extra_state reads it with torch.load, weights-only by default).
BYTE_RECORD_GLOBALS = (io.BytesIO,)
# Transformer Engine's FP8 extra state: pickle.dumps of a dict of tensors, plain values and the
# recipe. Storages come as torch.save bytes (torch.storage._load_from_bytes), read weights-only here.
TRANSFORMER_ENGINE = {
    "collections": frozenset({"OrderedDict"}),
    "torch._utils": frozenset({"_rebuild_tensor_v2"}),
    "torch": frozenset({"Size", "device", *_DTYPES}),
}
# Modules whose dataclasses and enums the extra state may hold (the FP8 recipe, its formats).
TRANSFORMER_ENGINE_RECIPES = "transformer_engine.common.recipe"


class RefusedPickle(pickle.UnpicklingError):
    """A pickle that refers to a global outside the allow-list; ``name`` is that global."""

    def __init__(self, name: str):
        super().__init__(f"it would call {name}, which a checkpoint may not")
        self.name = name

    def __reduce__(self):
        # torch DCP sends a reader's failure to the other ranks pickled.
        return type(self), (self.name,)


def _global(module: str, name: str, allowed: dict[str, frozenset[str]]) -> Any:
    if name not in allowed.get(module, ()):
        raise RefusedPickle(f"{module}.{name}")
    return getattr(importlib.import_module(module), name)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return _global(module, name, METADATA_GLOBALS)


def read_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """The torch DCP index ``path`` (a checkpoint's ``.metadata``); RefusedPickle for anything but
    DCP's metadata classes."""
    with open(path, "rb") as file:
        metadata = _MetadataUnpickler(file).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not torch DCP's Metadata")
    return metadata


class CheckpointReader(FileSystemReader):
    """torch DCP's file reader, its index read by ``read_dcp_metadata`` once per reader (torch reads
    it with full pickle, and Megatron asks for it twice per load)."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise ValueError("per-rank DCP indexes are not a torch_dist checkpoint's: read the one .metadata")
        if self._metadata is None:
            self._metadata = read_dcp_metadata(self._get_metadata_path())
            if getattr(self._metadata, "storage_meta", None) is None:
                self._metadata.storage_meta = StorageMeta()
            self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


_UNSUPPORTED_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")


def load_weights_only(source: str | os.PathLike | io.BytesIO) -> Any:
    """``torch.load(source)``, weights-only with BYTE_RECORD_GLOBALS allowed, on the host;
    RefusedPickle naming the global for a pickle that refers to anything else."""
    try:
        with torch.serialization.safe_globals(list(BYTE_RECORD_GLOBALS)):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        refused = _UNSUPPORTED_GLOBAL.search(str(error))
        if refused:
            raise RefusedPickle(refused.group(1)) from None
        raise


class _ExtraStateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_weights_only
        if module == TRANSFORMER_ENGINE_RECIPES:
            value = getattr(importlib.import_module(module), name, None)
            if isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum)):
                return value
            raise RefusedPickle(f"{module}.{name}")
        return _global(module, name, TRANSFORMER_ENGINE)


def _storage_weights_only(data: bytes) -> Any:
    return load_weights_only(io.BytesIO(data))


def check_extra_state(value: Any) -> None:
    """RefusedPickle unless each pickle inside ``value`` (a byte record as loaded) reads back as
    Transformer Engine's ``set_extra_state`` will read it, with TRANSFORMER_ENGINE's globals alone:
    a uint8 tensor (its FP8 state) with full pickle, a BytesIO (older releases) with torch.load."""
    if isinstance(value, (list, tuple)):
        for item in value:
            check_extra_state(item)
    elif isinstance(value, dict):
        for item in value.values():
            check_extra_state(item)
    elif isinstance(value, io.BytesIO):
        load_weights_only(io.BytesIO(value.getvalue()))
    elif isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1 and value.numel():
        _ExtraStateUnpickler(io.BytesIO(value.numpy().tobytes())).load()
