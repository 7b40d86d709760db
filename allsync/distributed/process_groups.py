"""The workers' process groups: all ranks (replicated LoRA gradients), expert-parallel groups (routed
tokens), expert-data-parallel groups (expert-adapter gradients).

Every group is a process group of its own, built on one TCP store through `PrefixStore(name, store)`:
- Ray: the controller picks `tcp://host:port` and rank 0 hosts the store.
- SPMD (torchrun / accelerate launch): torch.distributed's default group is initialized from the launcher's
  environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and its store carries the other groups.
Ray workers keep torch.distributed's default group free: an in-process vLLM engine initializes it for itself
(the torch engine's decode loop keeps expert-parallel ranks in step through the world group, `max_over_ranks`).
NCCL on GPUs, gloo on CPU; collectives are the groups' own methods (`allreduce`, `alltoall_base`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from moe_lora.expert_parallel import ExpertLayout

TIMEOUT = timedelta(minutes=10)


def open_store(address: str, rank: int, world_size: int) -> dist.Store:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=TIMEOUT)


def process_group(store: dist.Store, name: str, ranks: list[int], rank: int, backend: str):
    """A process group of `ranks` (global ranks, in group order) for a member; None for a non-member or a
    group of one (nothing to reduce)."""
    if rank not in ranks or len(ranks) == 1:
        return None
    prefixed = dist.PrefixStore(name, store)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(prefixed, ranks.index(rank), len(ranks))
    return dist.ProcessGroupGloo(prefixed, ranks.index(rank), len(ranks), TIMEOUT)


@dataclass
class Groups:
    """This rank's groups (None: a group of one). `waited` accumulates seconds blocked in collectives.
    Collectives run on `device` (cuda for NCCL, cpu for gloo); a tensor elsewhere is copied there and back."""

    rank: int
    world_size: int
    layout: ExpertLayout | None  # None: experts replicated (expert_parallel 1)
    world: object | None = None
    ep: object | None = None
    edp: object | None = None
    node: object | None = None  # the EP group's ranks on this node, when the EP group spans nodes (ExpertLayout)
    rail: object | None = None  # the EP group's ranks at this rank's place on each node, likewise
    waited: float = 0.0
    device: torch.device = torch.device("cpu")
    engine_lockstep: bool = False  # one rollout engine over all the ranks (rollout.engine_expert_parallel)

    @property
    def expert_parallel(self) -> bool:
        return self.layout is not None and self.layout.ep_size > 1

    @property
    def lockstep(self) -> bool:
        """Every rank makes every generate call (a rank with nothing of its own submits nothing): the trainer's
        experts are sharded (the torch engine exchanges tokens) or one engine spans the ranks."""
        return self.expert_parallel or self.engine_lockstep

    def all_reduce(self, tensor: torch.Tensor, group: str = "world", op=dist.ReduceOp.SUM) -> torch.Tensor:
        """In place over `group` (world, ep or edp); time blocked in it goes to `waited`."""
        pg = getattr(self, group)
        if pg is not None:
            t = time.time()
            opts = dist.AllreduceOptions()
            opts.reduceOp = op
            work = tensor.to(self.device)
            pg.allreduce([work], opts).wait()
            if work is not tensor:
                tensor.copy_(work)
            self.waited += time.time() - t
        return tensor

    def max_over_ranks(self, value: int) -> int:
        """The largest `value` any rank passes (every rank must call it): the lockstep counts under EP."""
        return int(self.all_reduce(torch.tensor([value], dtype=torch.int64), op=dist.ReduceOp.MAX)[0])

    def broadcast(self, tensor: torch.Tensor, group: str = "world") -> None:
        pg = getattr(self, group)
        if pg is not None:
            work = tensor.to(self.device)
            pg.broadcast(work, 0).wait()
            if work is not tensor:
                tensor.copy_(work)

    def all_gather(self, tensor: torch.Tensor, group: str) -> list[torch.Tensor]:
        """Equal-shaped tensors of every member of `group`, in group order ([tensor] for a group of one)."""
        pg = getattr(self, group)
        if pg is None:
            return [tensor]
        work = tensor.to(self.device).contiguous()
        out = [torch.empty_like(work) for _ in range(pg.size())]
        pg.allgather([out], [work]).wait()
        return [o.to(tensor.device) for o in out]


def connect(rank: int, world_size: int, address: str | None, backend: str, layout: ExpertLayout | None) -> Groups:
    """Build this rank's groups. address: `tcp://host:port` (Ray mode; rank 0 hosts the store), or None
    under a launcher (SPMD), which initializes torch.distributed's default group from the environment."""
    groups = Groups(
        rank,
        world_size,
        layout,
        device=torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu"),
    )
    if world_size == 1:
        return groups
    if address is None:
        if not dist.is_initialized():  # accelerate's PartialState usually has done it
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=TIMEOUT)
        store = dist.distributed_c10d._get_default_store()
        groups.world = dist.distributed_c10d._get_default_group()
    else:
        store = open_store(address, rank, world_size)
        groups.world = process_group(store, "world", list(range(world_size)), rank, backend)
    if layout is not None and layout.ep_size > 1:
        groups.ep = process_group(store, f"ep{rank // layout.ep_size}", layout.ep_group(rank), rank, backend)
        groups.edp = process_group(store, f"edp{layout.position(rank)}", layout.edp_group(rank), rank, backend)
        if layout.hierarchical:
            node, rail = layout.node_group(rank), layout.rail_group(rank)
            groups.node = process_group(store, f"node{node[0]}", node, rank, backend)
            groups.rail = process_group(store, f"rail{rail[0]}", rail, rank, backend)
    return groups


def disconnect() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
