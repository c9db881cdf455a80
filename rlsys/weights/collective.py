"""The `collective` weight transport: learner -> engines over a process group of their own (NCCL or gloo).

When learner and engine do not share a GPU (another node, or an engine on a GPU of its own), CUDA IPC is
impossible and the object store copies every byte through Ray. This transport does what verl and OpenRLHF do
for a separate rollout GPU: the source learner rank and the engines it feeds form a small group (the learner
is rank 0 and hosts the TCP rendezvous store), and every push is one broadcast per packed bucket buffer.

- The group lives outside torch.distributed's global state, so the learners' own (data-parallel) default
  group is untouched: on GPU it is vLLM's `StatelessProcessGroup` + `PyNcclCommunicator`, exactly as vLLM's
  examples/offline_inference/rlhf_utils.py builds it (a torch `ProcessGroupNCCL` on a `TCPStore` when vLLM is
  not importable; both sides of a route must see the same choice, i.e. run in the same environment); on CPU a
  `ProcessGroupGloo` on a `TCPStore`, built directly and never registered as a default group.
- The driver plans the route at job start and gives each side a `CollectiveTransport` on it, with its group rank
  (the learner 0, its engines 1..); groups are joined lazily, on the first push, where both sides meet at the
  rendezvous.
- The bucket plan (names, shapes, dtypes, offsets) travels through Ray once, as the payload of the first push
  (`export`; None afterwards); the receiver allocates one buffer per bucket on its device, reused by every later
  push. Only bytes go through the collective (`send`), one broadcast per bucket (never one per tensor).
- Every wait has a timeout (`CollectiveRoute.timeout_s`: the store's rendezvous and gloo's collectives); a
  side that never joins makes the other fail with `CollectiveError` naming the route, instead of hanging.
  NCCL collectives themselves have no timeout once the group exists (vLLM's communicator sets none).

Torch only at import time (vLLM is imported inside the NCCL path): the vLLM worker extension imports it.
"""
from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch

from rlsys.weights.buckets import TensorMeta, WeightBucket, bucket_size, unpack_bucket

DEFAULT_TIMEOUT_S = 120.0
_STORE_PREFIX = "rlsys-weights"


class CollectiveError(RuntimeError):
    """A weight route could not be joined or a broadcast failed; the message names the route."""


@dataclass(frozen=True)
class CollectiveRoute:
    """One weight group: the source learner rank (group rank 0, hosts the store) and the engines it feeds."""

    name: str  # for logs and errors, e.g. "learner-0 -> rollout-1"
    host: str  # the source learner's node IP, where its TCP store listens
    port: int
    world_size: int  # 1 (the learner) + the engines fed
    backend: str  # "nccl" (both sides on GPUs) | "gloo"
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"weight route {self.name}: backend {self.backend!r} is not nccl or gloo")
        if self.world_size < 2:
            raise ValueError(f"weight route {self.name}: world_size {self.world_size} < 2 (a learner and an engine)")


class WeightGroup:
    """A joined route: rank 0 broadcasts, every other rank receives. Blocks until all ranks joined."""

    def __init__(self, route: CollectiveRoute, rank: int, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:  # NCCL binds one device: name it
            device = torch.device("cuda", torch.cuda.current_device())
        self.route, self.rank, self.device = route, rank, device
        self._pg = self._comm = self._store = None
        try:
            if route.backend == "gloo":
                self._open_gloo()
            else:
                self._open_nccl()
        except Exception as err:
            side = "learner (rank 0)" if rank == 0 else f"engine (rank {rank})"
            raise CollectiveError(
                f"weight route {route.name}: the {side} could not form the group at {route.host}:{route.port} "
                f"(world size {route.world_size}, {route.backend}, timeout {route.timeout_s:g} s): the other side "
                f"did not join or cannot reach it. {type(err).__name__}: {err}"
            ) from err

    def _store_of(self, timeout: timedelta) -> torch.distributed.Store:
        from torch.distributed import PrefixStore, TCPStore

        # rank 0 waits (up to the timeout) until every rank has connected: a missing engine fails here
        self._store = TCPStore(self.route.host, self.route.port, self.route.world_size, is_master=self.rank == 0,
                               timeout=timeout, wait_for_workers=True)
        return PrefixStore(_STORE_PREFIX, self._store)

    def _open_gloo(self) -> None:
        from torch.distributed import ProcessGroupGloo

        timeout = timedelta(seconds=self.route.timeout_s)
        self._pg = ProcessGroupGloo(self._store_of(timeout), self.rank, self.route.world_size, timeout)

    def _open_nccl(self) -> None:
        try:
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup
        except ImportError:
            self._open_torch_nccl()
            return
        # vLLM's examples/offline_inference/rlhf_utils.py: stateless_init_process_group
        extra = {}
        if "store_timeout" in inspect.signature(StatelessProcessGroup.create).parameters:
            extra["store_timeout"] = int(self.route.timeout_s)
        pg = StatelessProcessGroup.create(host=self.route.host, port=self.route.port, rank=self.rank,
                                          world_size=self.route.world_size, **extra)
        self._comm = PyNcclCommunicator(pg, device=self.device)

    def _open_torch_nccl(self) -> None:
        from torch.distributed import ProcessGroupNCCL

        timeout = timedelta(seconds=self.route.timeout_s)
        torch.cuda.set_device(self.device)
        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        self._pg = ProcessGroupNCCL(self._store_of(timeout), self.rank, self.route.world_size, options)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's ``tensor`` into every other rank's ``tensor`` (same size and dtype on every rank)."""
        try:
            if self._comm is not None:  # vLLM's PyNcclCommunicator, as in rlhf_utils.py's update_weight
                self._comm.broadcast(tensor, src=0, stream=torch.cuda.current_stream(self.device))
                return
            from torch.distributed import BroadcastOptions

            opts = BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, 0
            opts.timeout = timedelta(seconds=self.route.timeout_s)
            self._pg.broadcast([tensor], opts).wait()
        except Exception as err:
            raise CollectiveError(f"weight route {self.route.name}: broadcast of {tensor.numel()} bytes failed on "
                                  f"rank {self.rank}: {type(err).__name__}: {err}") from err


class CollectiveTransport:
    """One side of a route: group rank 0 (the learner) `send`s every bucket buffer by broadcast, after `export`
    gave the engines the bucket plan (first push only); ranks 1.. (the engines) `receive` them into buffers of their
    own and return views. One object per process and route keeps the joined group and the receive buffers."""

    name = "collective"
    one_receiver = True  # the route gives each engine one group rank

    def __init__(self, route: CollectiveRoute | None = None, rank: int = 0) -> None:
        if route is not None and not 0 <= rank < route.world_size:
            raise ValueError(f"weight route {route.name}: rank {rank} outside 0..{route.world_size - 1}")
        self.route, self.rank = route, rank
        self._group: WeightGroup | None = None
        self._sent_plan: list[list[TensorMeta]] | None = None  # learner: the plan the engines have
        self._plan: list[list[TensorMeta]] | None = None  # engine: the plan its buffers follow
        self._buffers: list[torch.Tensor] = []  # (N_b,) uint8 per bucket, on the receiver's device

    def __getstate__(self) -> dict:
        return {"route": self.route, "rank": self.rank}  # a group and buffers belong to one process

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["route"], state["rank"])

    def _need_route(self) -> CollectiveRoute:
        if self.route is None:
            raise ValueError("collective: the transport needs its route (a CollectiveRoute, planned at job start)")
        return self.route

    def _joined(self, side: str, device: torch.device) -> WeightGroup:
        self._need_route()
        if (self.rank == 0) != (side == "learner"):
            raise ValueError(f"weight route {self.route.name}: group rank {self.rank} is "
                             f"{'the learner' if self.rank == 0 else 'an engine'}, not the {side}")
        if self._group is None:
            self._group = WeightGroup(self.route, self.rank, device)
        return self._group

    # ------------------------------------------------------------------ learner side
    def export(self, buckets: list[WeightBucket]) -> list[list[TensorMeta]] | None:
        """The engines' payload: the bucket plan when it differs from what they have (the first push), else None."""
        self._need_route()
        plan = [list(b.metas) for b in buckets]
        if plan == self._sent_plan:
            return None
        self._sent_plan = plan
        return plan

    def send(self, buckets: list[WeightBucket]) -> None:
        """Broadcast every bucket's buffer to the route's engines (they receive meanwhile)."""
        route = self._need_route()
        device = buckets[0].buffer.device if buckets else torch.device("cpu")
        nccl = route.backend == "nccl"
        if nccl and device.type != "cuda":
            raise CollectiveError(f"weight route {route.name}: nccl needs the learner's buffers on a GPU, "
                                  f"got {device}")
        if device.type == "cuda":  # the packing copies must be done before another stream reads the buffers
            torch.cuda.current_stream(device).synchronize()
        group = self._joined("learner", device if nccl else torch.device("cpu"))
        for b in buckets:
            group.broadcast(b.buffer if nccl or not b.buffer.is_cuda else b.buffer.cpu())

    # ------------------------------------------------------------------ engine side
    def receive(self, payload: list[list[TensorMeta]] | None,
                device: torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, view) pairs as the buckets arrive (``payload``: the learner's `export`, the plan or None), in
        buffers owned by this transport (overwritten by the next push) on ``device`` (default: CPU on gloo, this
        process's GPU on nccl)."""
        route = self._need_route()
        if device is None:
            nccl = route.backend == "nccl"
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        device = torch.device(device)
        if payload is not None and payload != self._plan:
            self._plan = payload
            self._buffers = [torch.empty(bucket_size(metas), dtype=torch.uint8, device=device) for metas in payload]
        if self._plan is None:
            raise CollectiveError(f"weight route {route.name}: no bucket plan yet (the first push carries it)")
        group = self._joined("engine", device)
        for buf, metas in zip(self._buffers, self._plan):
            group.broadcast(buf)
            yield from unpack_bucket(WeightBucket(buffer=buf, metas=metas))

    def counters(self) -> dict[str, int]:
        return {}
