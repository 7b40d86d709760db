"""Expert parallelism: the routed experts of every MoE layer sharded over an expert-parallel (EP) group.

Layout (`ExpertLayout`, pure): W ranks, EP size k with k | W and k | E. Rank r sits in EP group r // k at
position j = r % k and holds experts [j E/k, (j+1) E/k), their LoRA A/B and their optimizer state (the
equal contiguous blocks vLLM's LoRA slicing assumes). The ranks at position j of every EP group hold the
same experts: the expert-data-parallel (EDP) group {j, j+k, j+2k, ...}. Expert-adapter gradients are summed
over the EDP group only; every other LoRA gradient over all W ranks.

One MoE layer on a rank with T tokens routed to top-k experts (`ExpertDispatch`):
  1. the T*k assignments a = t*k + s are sorted by global expert, so destination rank e // (E/k) is sorted too
  2. counts per destination go through an all-to-all: every rank learns how many rows each peer sends it
  3. the token rows and their local expert ids go through an all-to-all (uneven splits)
  4. the local experts run on the received rows, each with weight 1 (a row is one assignment)
  5. the outputs come back through the all-to-all with the splits swapped
  6. out_t = sum_s w_ts * y_(t,s) on the token's own rank, so the router weights' gradient stays local.
Backward of an all-to-all is the all-to-all of the output gradient with the splits swapped (`_AllToAll`).

Every rank of an EP group must enter every MoE layer the same number of times (forward and backward), also
with no tokens of its own: the callers keep the ranks in lockstep (allsync.worker, allsync.engines.torch_engine).
The collectives are a process group's own `alltoall_base` (works on the bare gloo groups allsync builds,
where `dist.all_to_all_single(group=...)` and the autograd functional collectives do not; NCCL on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quant.modules import FrozenExperts


@dataclass(frozen=True)
class ExpertLayout:
    """Which rank holds which experts, and the EP / EDP groups (lists of global ranks)."""

    world_size: int
    ep_size: int
    num_experts: int

    def __post_init__(self):
        if self.ep_size < 1 or self.world_size % self.ep_size:
            raise ValueError(f"expert_parallel = {self.ep_size} must divide the {self.world_size} workers")
        if self.num_experts % self.ep_size:
            raise ValueError(f"expert_parallel = {self.ep_size} must divide the {self.num_experts} routed experts")

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def edp_size(self) -> int:
        return self.world_size // self.ep_size

    def position(self, rank: int) -> int:
        """j = r mod k: the rank's place in its EP group, which fixes its experts."""
        return rank % self.ep_size

    def experts_of(self, rank: int) -> range:
        j = self.position(rank)
        return range(j * self.experts_per_rank, (j + 1) * self.experts_per_rank)

    def ep_group(self, rank: int) -> list[int]:
        first = rank - self.position(rank)
        return list(range(first, first + self.ep_size))

    def edp_group(self, rank: int) -> list[int]:
        return list(range(self.position(rank), self.world_size, self.ep_size))


@dataclass
class DispatchStats:
    """What this rank's all-to-alls moved, summed over calls: `assignments` routed (token, expert) pairs of its
    own tokens in forward passes; rows it sent to other ranks in forward passes (tokens out, outputs back:
    2 x assignments x (k-1)/k under uniform routing) and in backward passes (their gradients); all bytes sent
    to other ranks. Rows a rank keeps for its own experts cost nothing."""

    assignments: int = 0
    forward_rows_remote: int = 0
    backward_rows_remote: int = 0
    bytes_remote: int = 0
    forward_rows_received: int = 0  # rows this rank received in forward passes: its experts' load, and its outputs back

    def take(self) -> dict:
        """The totals since the last take, then zeroed."""
        out = {
            "alltoall_bytes": self.bytes_remote,
            "alltoall_forward_rows": self.forward_rows_remote,
            "alltoall_backward_rows": self.backward_rows_remote,
            "routed_assignments": self.assignments,
            "alltoall_received_rows": self.forward_rows_received,
        }
        self.assignments = self.forward_rows_remote = self.backward_rows_remote = self.bytes_remote = (
            self.forward_rows_received
        ) = 0
        return out


def all_to_all(
    x: torch.Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group,
    stats: DispatchStats | None = None,
    backward: bool = False,
) -> torch.Tensor:
    """Rows x[sum(send_splits[:i]) : sum(send_splits[:i+1])] go to peer i; returns the rows received, peer by peer."""
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    group.alltoall_base(out, x.contiguous(), list(recv_splits), list(send_splits)).wait()
    if stats is not None:
        remote = sum(send_splits) - send_splits[group.rank()]
        if backward:
            stats.backward_rows_remote += remote
        else:
            stats.forward_rows_remote += remote
            stats.forward_rows_received += sum(recv_splits)
        stats.bytes_remote += remote * x[0].numel() * x.element_size() if len(x) else 0
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all with autograd: backward sends the gradient rows back where they came from."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group, stats):
        ctx.send_splits, ctx.recv_splits, ctx.group, ctx.stats = send_splits, recv_splits, group, stats
        return all_to_all(x, send_splits, recv_splits, group, stats)

    @staticmethod
    def backward(ctx, grad):
        return (
            all_to_all(grad, ctx.recv_splits, ctx.send_splits, ctx.group, ctx.stats, backward=True),
            None,
            None,
            None,
            None,
        )


class ExpertDispatch:
    """Routes a MoE layer's tokens to the ranks of `group` that hold their experts and combines the results.

    group: a process group of the EP group's ranks, in EP order (rank i of the group holds block i)."""

    def __init__(self, group, ep_size: int, experts_per_rank: int, stats: DispatchStats | None = None):
        self.group, self.ep_size, self.experts_per_rank = group, ep_size, experts_per_rank
        self.stats = stats if stats is not None else DispatchStats()

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, local_forward):
        k = top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        with torch.no_grad():
            order = torch.argsort(flat, stable=True)  # assignments by expert, hence by destination rank
            expert = flat[order]
            destination = torch.div(expert, self.experts_per_rank, rounding_mode="floor")
            local_ids = expert - destination * self.experts_per_rank
            send_counts = torch.bincount(destination, minlength=self.ep_size)
            recv_counts = all_to_all(send_counts, [1] * self.ep_size, [1] * self.ep_size, self.group)
            send, recv = send_counts.tolist(), recv_counts.tolist()  # one host sync per layer: the splits
            ids_received = all_to_all(local_ids, send, recv, self.group)
        tokens = order // k
        rows = _AllToAll.apply(hidden.index_select(0, tokens), send, recv, self.group, self.stats)
        ones = torch.ones((rows.shape[0], 1), dtype=hidden.dtype, device=hidden.device)
        outputs = _AllToAll.apply(local_forward(rows, ids_received[:, None], ones), recv, send, self.group, self.stats)
        weights = top_k_weights.reshape(-1)[order].to(hidden.dtype)
        self.stats.assignments += len(tokens)
        return hidden.new_zeros(hidden.shape).index_add(0, tokens, outputs * weights[:, None])

    def gathered(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] of every rank of the group, in rank order: [W T, ...] (an all-to-all of equal splits: the same
        T on every rank, no host read)."""
        w, t = self.ep_size, x.shape[0]
        return all_to_all(x.expand(w, *x.shape).reshape(w * t, *x.shape[1:]), [t] * w, [t] * w, self.group)

    def fixed_shape(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, local_share):
        """The MoE output of this rank's T tokens in fixed shapes (quant.fixed_shape_experts: what a CUDA graph can
        capture; every rank of the group calls it with the same T): every rank's tokens and routing gathered;
        local_share(x [W T, H], top_k_index [W T, k] (global ids), weights) -> [W T, H], this rank's experts' share of
        each token's output; each rank's tokens' shares sent back to it and summed in rank order:
            out_t = sum over ranks r of share_r(t)."""
        tokens = hidden.shape[0]
        shares = local_share(self.gathered(hidden), self.gathered(top_k_index), self.gathered(top_k_weights))
        back = all_to_all(shares, [tokens] * self.ep_size, [tokens] * self.ep_size, self.group)
        return back.view(self.ep_size, tokens, -1).sum(0)


def shard_experts(model: nn.Module, group, layout: ExpertLayout, rank: int) -> DispatchStats:
    """Give every routed-expert module of a model loaded with `experts=layout.experts_of(rank)` its dispatcher
    (one shared DispatchStats). Checks that the loaded shard is this rank's."""
    stats = DispatchStats()
    mine = layout.experts_of(rank)
    for name, module in model.named_modules():
        if isinstance(module, FrozenExperts):
            held = range(module.first_expert, module.first_expert + module.num_experts)
            if held != mine:
                raise ValueError(
                    f"{name} holds experts {held.start}..{held.stop - 1}; rank {rank} of {layout} owns {mine.start}..{mine.stop - 1}"
                )
            module.dispatch = ExpertDispatch(group, layout.ep_size, layout.experts_per_rank, stats)
    return stats


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed-expert LoRA tensors held per expert (their gradients are summed over the EDP group, not over all
    ranks); the factors a shared_outer layer's experts share are replicated like attention's."""
    from moe_lora.lora_layers import LoRAExperts

    return [p for m in model.modules() if isinstance(m, LoRAExperts) for p in m.per_expert_parameters()]
