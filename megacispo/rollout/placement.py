"""Rollouts on processes of their own (placement.rollout_ranks = K): the two sides and the bridge
between them.

The first N - K processes of torchrun's world train and the last K generate. Each side is a
torch.distributed world of its own, started on the launcher's store under its own prefix, so that
everything written against the default process group (Megatron-Core's parallel_state, checkpoints,
the trainer's collectives, evaluation) runs unchanged on the training side, and the rollout side
starts Megatron-Core at TP = PP = EP = 1 over its K processes (K whole-model replicas).

The bridge is a process group of training rank 0 (bridge rank 0) and the K rollout processes (bridge
ranks 1..K), and a group of two of each rollout process with training rank 0, built on the same store
under a third prefix: gloo on the CPU, NCCL on GPUs. Training rank 0 broadcasts to the rollout
processes (requests, weights, the stop) without waiting for them to receive, so training never waits
on generation; each rollout process sends its share of a round back to it as a broadcast in their
group of two (gloo's point-to-point work tells that it is complete only to its blocking wait()).

A sender counts what it posted in the store, and a receiver posts its receive only once the sender
has: NCCL's wait() does not block the host, so a receive posted early would neither see a dead sender
nor finish, and would run into NCCL's watchdog while the sender generates a round or trains a step.
Every bridge process beats a heartbeat into the store from a thread of its own; a process that waits on
the bridge watches its peer's, and raises an error naming the peer, what it waited for and for how
long once the peer has not beaten for the liveness bound (``start_placement``): the peer died, or its
whole process stopped. A send waits for its receiver as long as the receiver's schedule needs (a
round's generation or a training step): the heartbeats bound it, not the group's collective timeout.

The weights cross the bridge after each step: megacispo.rollout.weight_sync.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from megacispo.parallel.layout import ParallelConfig
from megacispo.rollout.config import PlacementConfig

_TRAINING, _ROLLOUT, _BRIDGE = "megacispo/training", "megacispo/rollout", "megacispo/bridge"
# Heartbeats per liveness bound; a waiting process polls at most this often per bound, after a first
# poll this soon (a receive whose send is already posted).
_BEATS_PER_BOUND = 10
_FIRST_POLL_S = 0.001
# The bridge group's own collective timeout. A send completes when its receiver gets to it, after the
# receiver's round or step, however long that takes; the heartbeats detect a receiver that is gone.
_BRIDGE_COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)


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
    Every wait watches the peer's heartbeat: see the module's docstring.
    """

    def __init__(self, group: dist.ProcessGroup, pairs: dict[int, dist.ProcessGroup], store: dist.Store, rank: int,
                 num_training: int, device: torch.device, liveness_timeout_s: float):
        self.group = group
        self.pairs = pairs
        """Each rollout process's group of two with bridge rank 0 (its own alone, on a rollout process)."""
        self.store = store
        self.rank = rank
        self.num_training = num_training
        self.device = device
        self.liveness_timeout_s = liveness_timeout_s
        self._in_flight: list[tuple[Any, torch.Tensor, list[int]]] = []
        # Tensors received so far: from bridge rank 0's broadcasts, and from each rollout process's sends.
        self._received = [0] * group.size()
        # Each peer's last heartbeat count seen, and when (time.monotonic()) it last changed.
        self._heartbeats: dict[int, tuple[int | None, float]] = {}
        self._done = threading.Event()
        threading.Thread(target=self._beat, name="bridge-heartbeat", daemon=True).start()

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

    def broadcast_tensor(self, tensor: torch.Tensor, what: str = "a tensor") -> None:
        """From bridge rank 0: sent without waiting; elsewhere: received into ``tensor`` (``what`` it is,
        for the error when bridge rank 0 stops answering)."""
        if self.rank == 0:
            self._keep(self.group.broadcast([tensor], _from_rank(0)), tensor, list(range(1, self.group.size())))
            self.store.add(_posted_key(0), 1)
            return
        self._await_posted(0, what)
        self._wait(self.group.broadcast([tensor], _from_rank(0)), 0, what)

    def broadcast_object(self, obj: Any = None, what: str = "a message") -> Any:
        """``obj`` from bridge rank 0 (pickled); what it sent, on the rollout processes."""
        if self.rank == 0:
            payload = _to_bytes(obj, self.device)
            self.broadcast_tensor(torch.tensor([payload.numel()], dtype=torch.long, device=self.device))
            self.broadcast_tensor(payload)
            return obj
        length = torch.zeros(1, dtype=torch.long, device=self.device)
        self.broadcast_tensor(length, what)
        payload = torch.empty(int(length), dtype=torch.uint8, device=self.device)
        self.broadcast_tensor(payload, what)
        return _from_bytes(payload)

    # -- a rollout process to bridge rank 0 -----------------------------------------------------

    def send_object(self, obj: Any) -> None:
        """To bridge rank 0, without waiting for it to receive."""
        payload = _to_bytes(obj, self.device)
        length = torch.tensor([payload.numel()], dtype=torch.long, device=self.device)
        for tensor in (length, payload):
            # Rank 1 of the group of two is the rollout process.
            self._keep(self.pairs[self.rank].broadcast([tensor], _from_rank(1)), tensor, [0])
            self.store.add(_posted_key(self.rank), 1)

    def receive_object(self, bridge_rank: int, what: str = "a message") -> Any:
        """The next object rollout process ``bridge_rank`` sent (``what`` it is, for the error);
        RolloutProcessLost when it died or stopped."""
        length = torch.zeros(1, dtype=torch.long, device=self.device)
        self._receive(length, bridge_rank, what)
        payload = torch.empty(int(length), dtype=torch.uint8, device=self.device)
        self._receive(payload, bridge_rank, what)
        return _from_bytes(payload)

    def flush(self) -> None:
        """Wait until what this process sent has been received, then stop the heartbeat: the last call
        on the bridge, before the process exits."""
        for work, _, peers in self._in_flight:
            self._await(work.is_completed, peers, "the receipt of what this process sent")
            work.wait()
        self._in_flight = []
        self._done.set()

    # -- waits ------------------------------------------------------------------------------------

    def _receive(self, tensor: torch.Tensor, peer: int, what: str) -> None:
        self._await_posted(peer, what)
        self._wait(self.pairs[peer].broadcast([tensor], _from_rank(1)), peer, what)

    def _await_posted(self, peer: int, what: str) -> None:
        """Until ``peer`` has posted the next tensor this process receives from it."""
        self._received[peer] += 1
        self._await(lambda: self.store.add(_posted_key(peer), 0) >= self._received[peer], [peer], what)

    def _wait(self, work, peer: int, what: str) -> None:
        """Wait for a receive that ``peer`` has posted the send of; what fails names ``peer``."""
        self._await(work.is_completed, [peer], what)
        try:
            work.wait()
        except RuntimeError as error:  # gloo's and NCCL's errors: a connection that closed, a timeout
            raise self._lost(peer, f"{str(error).splitlines()[0] if str(error) else type(error).__name__}") from None

    def _await(self, done: Callable[[], bool], peers: list[int], what: str) -> None:
        """Poll ``done`` until it holds, while each of ``peers`` beats its heartbeat: a peer is lost once
        silent for the liveness bound within this wait (a peer that was stopped before it and runs again
        gets a bound to beat: only a silence inside the wait counts)."""
        start = time.monotonic()
        delay = _FIRST_POLL_S
        while True:
            try:
                if done():
                    return
                waited = time.monotonic() - start
                silent = {peer: min(self._silent_s(peer), waited) for peer in peers}
            except RuntimeError as error:  # the store's: its server, in training process 0, is gone
                raise self._lost(0, f"the store does not answer: {str(error).splitlines()[0]}") from None
            peer, longest = max(silent.items(), key=lambda item: item[1])
            if longest > self.liveness_timeout_s:
                raise self._lost(peer, f"no heartbeat for {longest:.1f} s (the liveness bound is "
                                       f"{self.liveness_timeout_s:g} s) while {self.describe(self.rank)} waited "
                                       f"{waited:.1f} s for {what}")
            time.sleep(delay)
            delay = min(2 * delay, self.liveness_timeout_s / _BEATS_PER_BOUND)

    def _silent_s(self, peer: int) -> float:
        """Seconds since ``peer``'s heartbeat count last changed (or since this process first looked)."""
        count = self.store.add(_heartbeat_key(peer), 0)
        now = time.monotonic()
        seen, since = self._heartbeats.get(peer, (None, now))
        if count != seen:
            self._heartbeats[peer] = (count, now)
            return 0.0
        return now - since

    def _lost(self, peer: int, why: str) -> RuntimeError:
        lost = RolloutProcessLost if peer else RuntimeError
        return lost(f"{self.describe(peer)} stopped answering (it died or hung; its own log says why): {why}")

    def _beat(self) -> None:
        """The heartbeat, until ``flush`` (or the store's server, in training process 0, exits first)."""
        with contextlib.suppress(RuntimeError):
            while True:
                self.store.add(_heartbeat_key(self.rank), 1)
                if self._done.wait(self.liveness_timeout_s / _BEATS_PER_BOUND):
                    return

    def _keep(self, work, tensor: torch.Tensor, peers: list[int]) -> None:
        """Hold ``tensor`` until its send to ``peers`` completes (forgetting those whose sends have)."""
        self._in_flight = [entry for entry in self._in_flight if not entry[0].is_completed()]
        self._in_flight.append((work, tensor, peers))


def _from_rank(root: int) -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = root
    return options


def _posted_key(bridge_rank: int) -> str:
    return f"posted/{bridge_rank}"


def _heartbeat_key(bridge_rank: int) -> str:
    return f"heartbeat/{bridge_rank}"


def _to_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)


def _from_bytes(payload: torch.Tensor) -> Any:
    # Only the run's own processes write to the bridge: what it carries is as trusted as the code.
    return pickle.loads(payload.cpu().numpy().tobytes())


def start_placement(settings: PlacementConfig, parallel: ParallelConfig) -> Side:
    """Start this process's side (its default process group: the training or the rollout processes)
    and the bridge, from torchrun's environment, with the layout's collective timeout; a bridge
    process that sends no heartbeat for placement.liveness_timeout_s counts as lost (20 s by default:
    well above the longest stop of a live process's threads, a garbage collection or pickling a
    round's share, well below a run's patience). The caller then starts
    Megatron-Core on the side with ``init_distributed`` (the side's group is already there)."""
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
        bridge_store = dist.PrefixStore(_BRIDGE, store)
        _await_arrivals(bridge_store, bridge_rank, num_training, num_rollout, timeout)
        group = _bridge_group(dist.PrefixStore("group", bridge_store), bridge_rank, num_rollout + 1, use_cuda)
        pairs = {peer: _bridge_group(dist.PrefixStore(f"pair/{peer}", bridge_store), int(is_rollout), 2, use_cuda)
                 for peer in ([bridge_rank] if is_rollout else range(1, num_rollout + 1))}
        device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        for joined in (group, *pairs.values()):
            _connect(joined, device)
        bridge = Bridge(group, pairs, bridge_store, bridge_rank, num_training, device, settings.liveness_timeout_s)
    return Side(is_rollout, num_training, num_rollout, bridge)


def _await_arrivals(store: dist.Store, bridge_rank: int, num_training: int, num_rollout: int,
                    timeout: datetime.timedelta) -> None:
    """Until every bridge process is there, within the layout's collective timeout (the bridge group's
    own, which its start would wait for, is far longer)."""
    store.set(f"arrived/{bridge_rank}", "1")
    try:
        store.wait([f"arrived/{peer}" for peer in range(num_rollout + 1)], timeout)
    except dist.DistStoreError:
        missing = [peer for peer in range(num_rollout + 1) if not store.check([f"arrived/{peer}"])]
        world_ranks = [0 if peer == 0 else num_training + peer - 1 for peer in missing]
        raise RuntimeError(f"the bridge's processes of world ranks {world_ranks} did not start within "
                           f"parallel.distributed_timeout_minutes = {timeout.total_seconds() / 60:g}: their "
                           f"logs say why") from None


def _connect(group: dist.ProcessGroup, device: torch.device) -> None:
    """A first collective on ``group``, which every member makes here at the start: NCCL builds a
    group's communicator at its first collective, blocking until every member joins, which a send
    would otherwise do before its receiver has seen it posted."""
    group.broadcast([torch.zeros(1, device=device)], _from_rank(0)).wait()


def _bridge_group(store, rank: int, size: int, use_cuda: bool) -> dist.ProcessGroup:
    if use_cuda:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = _BRIDGE_COLLECTIVE_TIMEOUT
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, _BRIDGE_COLLECTIVE_TIMEOUT)
