"""Rollouts on processes of their own (placement.rollout_ranks = K): the two sides and the bridge
between them.

The first N - K processes of torchrun's world train and the last K generate. Each side is a
torch.distributed world of its own, started on the launcher's store under its own prefix, so that
everything written against the default process group (Megatron-Core's parallel_state, checkpoints,
the trainer's collectives, evaluation) runs unchanged on the training side, and the rollout side
starts Megatron-Core at TP = PP = EP = 1 over its K processes (K whole-model replicas).

The bridge is a process group of training rank 0 (bridge rank 0) and the K rollout processes (bridge
ranks 1..K), built on the same store under a third prefix: gloo on the CPU, NCCL on GPUs. Training
rank 0 broadcasts to the rollout processes (requests, weights, the stop) without waiting for them to
receive, so training never waits on generation; the rollout processes send each their share of a
round back to it. A receive on either side fails, instead of hanging, when the process at the other
end has died (the connection closes) or after parallel.distributed_timeout_minutes.

The weights cross the bridge after each step: megacispo.rollout.weight_sync.
"""

from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from megacispo.parallel.layout import ParallelConfig
from megacispo.rollout.config import PlacementConfig

_TRAINING, _ROLLOUT, _BRIDGE = "megacispo/training", "megacispo/rollout", "megacispo/bridge"


class RolloutProcessLost(RuntimeError):
    """A rollout process died or stopped answering: the run cannot get its samples."""


@dataclass
class Side:
    """Where this process sits in a run with rollout processes."""

    is_rollout: bool
    """This process generates (the last placement.rollout_ranks of the world) rather than trains."""
    num_training: int
    """Processes that train (the first of torchrun's world)."""
    num_rollout: int
    """Processes that generate."""
    bridge: Bridge | None
    """Training rank 0 and the rollout processes; None on the other training ranks."""


class Bridge:
    """Messages and tensors between training rank 0 (bridge rank 0) and the rollout processes.

    Bridge rank 0 broadcasts without waiting (the buffers are kept until their sends complete); the
    rollout processes receive every broadcast, in order. Each rollout process sends to bridge rank 0.
    """

    def __init__(self, group: dist.ProcessGroup, rank: int, num_training: int, device: torch.device):
        self.group = group
        self.rank = rank
        self.num_training = num_training
        self.device = device
        self._in_flight: list[tuple[Any, torch.Tensor]] = []

    @property
    def num_rollout(self) -> int:
        return self.group.size() - 1

    def describe(self, bridge_rank: int) -> str:
        """A bridge rank as the launcher names it."""
        if bridge_rank == 0:
            return "training process 0 (rank 0 of the world)"
        return (f"rollout process {bridge_rank - 1} of {self.num_rollout} (rank {self.num_training + bridge_rank - 1} "
                f"of the world)")

    # -- bridge rank 0 to every rollout process --------------------------------------------------

    def broadcast_tensor(self, tensor: torch.Tensor) -> None:
        """From bridge rank 0: sent without waiting; elsewhere: received into ``tensor``."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        work = self.group.broadcast([tensor], options)
        if self.rank == 0:
            self._keep(work, tensor)
        else:
            self._wait(lambda: work, 0)

    def broadcast_object(self, obj: Any = None) -> Any:
        """``obj`` from bridge rank 0 (pickled); what it sent, on the rollout processes."""
        if self.rank == 0:
            payload = _to_bytes(obj, self.device)
            self.broadcast_tensor(torch.tensor([payload.numel()], dtype=torch.long, device=self.device))
            self.broadcast_tensor(payload)
            return obj
        length = torch.zeros(1, dtype=torch.long, device=self.device)
        self.broadcast_tensor(length)
        payload = torch.empty(int(length), dtype=torch.uint8, device=self.device)
        self.broadcast_tensor(payload)
        return _from_bytes(payload)

    # -- a rollout process to bridge rank 0 -----------------------------------------------------

    def send_object(self, obj: Any) -> None:
        """To bridge rank 0, without waiting for it to receive."""
        payload = _to_bytes(obj, self.device)
        length = torch.tensor([payload.numel()], dtype=torch.long, device=self.device)
        for tensor in (length, payload):
            self._keep(self.group.send([tensor], 0, 0), tensor)

    def receive_object(self, bridge_rank: int) -> Any:
        """The next object rollout process ``bridge_rank`` sent; RolloutProcessLost when it died or hung."""
        length = torch.zeros(1, dtype=torch.long, device=self.device)
        self._receive(length, bridge_rank)
        payload = torch.empty(int(length), dtype=torch.uint8, device=self.device)
        self._receive(payload, bridge_rank)
        return _from_bytes(payload)

    def _receive(self, tensor: torch.Tensor, peer: int) -> None:
        # recv itself raises when the peer's connection is already closed; wait() when it closes later.
        self._wait(lambda: self.group.recv([tensor], peer, 0), peer)

    def _wait(self, post: Callable[[], Any], peer: int) -> None:
        """Post a communication (``post`` returns its work) and wait for it; what fails names ``peer``."""
        try:
            post().wait()
        except RuntimeError as error:  # gloo's and NCCL's errors, a closed connection's and a timeout's
            lost = RolloutProcessLost if peer else RuntimeError
            raise lost(f"{self.describe(peer)} stopped answering (it died or hung; its own log says why): "
                       f"{str(error).splitlines()[0] if str(error) else type(error).__name__}") from None

    def _keep(self, work, tensor: torch.Tensor) -> None:
        """Hold ``tensor`` until its send completes (forgetting those whose sends have)."""
        self._in_flight = [(w, t) for w, t in self._in_flight if not w.is_completed()] + [(work, tensor)]

    def flush(self) -> None:
        """Wait until what this process sent has been received (before it exits)."""
        for work, _ in self._in_flight:
            work.wait()
        self._in_flight = []


def _to_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _from_bytes(payload: torch.Tensor) -> Any:
    # Only the run's own processes write to the bridge: what it carries is as trusted as the code.
    return pickle.loads(payload.cpu().numpy().tobytes())


def start_placement(settings: PlacementConfig, parallel: ParallelConfig) -> Side:
    """Start this process's side (its default process group: the training or the rollout processes)
    and the bridge, from torchrun's environment, with the layout's collective timeout. The caller then
    starts Megatron-Core on the side with ``init_distributed`` (the side's group is already there)."""
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    num_rollout = settings.rollout_ranks
    num_training = world_size - num_rollout
    timeout = datetime.timedelta(minutes=parallel.distributed_timeout_minutes)
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    is_rollout = rank >= num_training
    side_rank = rank - num_training if is_rollout else rank
    dist.init_process_group(
        "nccl" if use_cuda else "gloo", store=dist.PrefixStore(_ROLLOUT if is_rollout else _TRAINING, store),
        rank=side_rank, world_size=num_rollout if is_rollout else num_training, timeout=timeout,
    )
    bridge = None
    if is_rollout or rank == 0:
        bridge_rank = side_rank + 1 if is_rollout else 0
        group = _bridge_group(dist.PrefixStore(_BRIDGE, store), bridge_rank, num_rollout + 1, timeout, use_cuda)
        device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        bridge = Bridge(group, bridge_rank, num_training, device)
    return Side(is_rollout, num_training, num_rollout, bridge)


def _bridge_group(store, rank: int, size: int, timeout: datetime.timedelta, use_cuda: bool) -> dist.ProcessGroup:
    if use_cuda:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)
