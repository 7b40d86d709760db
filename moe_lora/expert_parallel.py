"""Expert parallelism: the routed experts of every MoE layer sharded over an expert-parallel (EP) group.

Layout (`ExpertLayout`, pure): W ranks, EP size k with k | W and k | E. Rank r sits in EP group r // k at
position j = r % k and holds experts [j E/k, (j+1) E/k), their LoRA A/B and their optimizer state (the
equal contiguous blocks vLLM's LoRA slicing assumes). The ranks at position j of every EP group hold the
same experts: the expert-data-parallel (EDP) group {j, j+k, j+2k, ...}. Expert-adapter gradients are summed
over the EDP group only; every other LoRA gradient over all W ranks. Nodes hold `ranks_per_node` consecutive
ranks; an EP group that spans n > 1 whole nodes (ranks_per_node | k) is split into node groups (its ranks on one
node) and rails (its ranks at the same place on every node).

One MoE layer on a rank with T tokens routed to top-k experts (`ExpertDispatch`, `route`), deduplicated: a token
travels once to each rank that holds one or more of its experts, carrying the ids and router weights of the
experts it meets there (the others padded with -1 and weight 0); that rank runs its experts on it and sends back
one row, sum_j w_tj y_j over those experts, and the token's rank adds the rows it gets back:
    out_t = sum over destinations d of sum_{j: e_tj on d} w_tj * expert_{e_tj}(x_t).
A row per (token, destination rank) instead of per (token, expert): about 5.4 of 8 for DeepSeek-V3's routing at
EP 16 (allsync.plan.step_time.expected_places). Across nodes the exchange is hierarchical (the way DeepEP's
normal kernels go): a token crosses the network once per node that holds one of its experts, to the rank at its
own place on that node (the rail all-to-all), which forwards it inside the node to the ranks holding the experts
(the node all-to-all, NVLink on GPUs); the outputs come back the same way, summed at each hop. Each hop is one
count exchange (one host read of the splits) and all-to-alls of uneven splits; backward of an all-to-all is the
all-to-all of the output gradient with the splits swapped (`_AllToAll`), and the router weights' gradient comes
back with it.

Every rank of an EP group must enter every MoE layer the same number of times (forward and backward), also
with no tokens of its own: the callers keep the ranks in lockstep (allsync.run.worker, allsync.engines.torch_engine).
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
    """Which rank holds which experts, and the EP / EDP groups (lists of global ranks). ranks_per_node: the ranks
    of one machine (None: every rank on one), which splits an EP group spanning nodes into node groups and rails."""

    world_size: int
    ep_size: int
    num_experts: int
    ranks_per_node: int | None = None

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

    @property
    def nodes_spanned(self) -> int:
        """Whole nodes an EP group spans (1 inside a node, or when nodes do not split it evenly)."""
        per_node = self.ranks_per_node or self.world_size
        return self.ep_size // per_node if per_node < self.ep_size and self.ep_size % per_node == 0 else 1

    @property
    def group_ranks_per_node(self) -> int:
        """The ranks of one EP group on each node it spans."""
        return self.ep_size // self.nodes_spanned

    @property
    def hierarchical(self) -> bool:
        """The dispatch crosses nodes by rail then node (both groups of more than one rank)."""
        return self.nodes_spanned > 1 and self.group_ranks_per_node > 1

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

    def node_group(self, rank: int) -> list[int]:
        """The ranks of rank's EP group on rank's node (hierarchical layouts)."""
        per_node = self.group_ranks_per_node
        first = rank - self.position(rank) % per_node
        return list(range(first, first + per_node))

    def rail_group(self, rank: int) -> list[int]:
        """The ranks of rank's EP group at rank's place on each node, node by node (hierarchical layouts)."""
        per_node = self.group_ranks_per_node
        first = rank - self.position(rank) + self.position(rank) % per_node
        return list(range(first, first + self.ep_size, per_node))


@dataclass
class DispatchStats:
    """What this rank's all-to-alls moved, summed over calls: `assignments` routed (token, expert) pairs of its
    own tokens in forward passes; token rows it sent to other ranks in forward passes (tokens out, outputs back,
    at every hop) and in backward passes (their gradients); all bytes sent to other ranks (rows, expert ids, router
    weights), and the part of them sent to other nodes. Rows a rank keeps for its own experts cost nothing."""

    assignments: int = 0
    forward_rows_remote: int = 0
    backward_rows_remote: int = 0
    bytes_remote: int = 0
    bytes_across_nodes: int = 0
    forward_rows_received: int = 0  # rows this rank received in forward passes: its experts' load, and its outputs back

    def take(self) -> dict:
        """The totals since the last take, then zeroed."""
        out = {
            "alltoall_bytes": self.bytes_remote,
            "alltoall_bytes_across_nodes": self.bytes_across_nodes,
            "alltoall_forward_rows": self.forward_rows_remote,
            "alltoall_backward_rows": self.backward_rows_remote,
            "routed_assignments": self.assignments,
            "alltoall_received_rows": self.forward_rows_received,
        }
        self.assignments = self.forward_rows_remote = self.backward_rows_remote = self.bytes_remote = 0
        self.bytes_across_nodes = self.forward_rows_received = 0
        return out


@dataclass(frozen=True)
class Hop:
    """One stage of the dispatch: a process group (members in order) and which member an expert's rows go to,
    member(e) = (e // span) mod size. other_node[m]: member m is on another node than this rank."""

    group: object
    size: int
    span: int
    other_node: tuple[bool, ...]

    def member(self, experts: torch.Tensor) -> torch.Tensor:
        """The member each expert id leads to (-1 for the padding id -1)."""
        return torch.where(experts >= 0, torch.div(experts, self.span, rounding_mode="floor") % self.size, -1)

    def count(self, stats: DispatchStats | None, x: torch.Tensor, send: list[int], recv: list[int], kind: str) -> None:
        """Adds one exchange of x's rows to stats; kind: rows (token rows of a forward pass), gradients (their
        backward), or bytes (ids and weights: bytes only)."""
        if stats is None:
            return
        me = self.group.rank()
        row_bytes = x[0].numel() * x.element_size() if len(x) else 0
        remote = sum(send) - send[me]
        stats.bytes_remote += remote * row_bytes
        stats.bytes_across_nodes += sum(s for s, far in zip(send, self.other_node) if far) * row_bytes
        if kind == "rows":
            stats.forward_rows_remote += remote
            stats.forward_rows_received += sum(recv)
        elif kind == "gradients":
            stats.backward_rows_remote += remote


def hops_of(layout: ExpertLayout, rank: int, ep_group, node_group=None, rail_group=None) -> list[Hop]:
    """The dispatch's hops for `rank`: the rail then the node group when the layout is hierarchical, else the whole
    EP group."""
    per_rank = layout.experts_per_rank
    if not layout.hierarchical:
        per_node = layout.ranks_per_node or layout.world_size
        ranks = layout.ep_group(rank)
        far = tuple(r // per_node != rank // per_node for r in ranks)
        return [Hop(ep_group, layout.ep_size, per_rank, far)]
    if node_group is None or rail_group is None:
        raise ValueError(f"{layout} spans {layout.nodes_spanned} nodes: the dispatch needs its node and rail groups")
    nodes, per_node = layout.nodes_spanned, layout.group_ranks_per_node
    me = layout.position(rank) // per_node
    return [
        Hop(rail_group, nodes, per_rank * per_node, tuple(m != me for m in range(nodes))),
        Hop(node_group, per_node, per_rank, (False,) * per_node),
    ]


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """Rows x[sum(send_splits[:i]) : sum(send_splits[:i+1])] go to peer i; returns the rows received, peer by peer."""
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    group.alltoall_base(out, x.contiguous(), list(recv_splits), list(send_splits)).wait()
    return out


class _AllToAll(torch.autograd.Function):
    """all_to_all with autograd: backward sends the gradient rows back where they came from."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, hop, stats, kind):
        ctx.send_splits, ctx.recv_splits, ctx.hop, ctx.stats, ctx.kind = send_splits, recv_splits, hop, stats, kind
        hop.count(stats, x, send_splits, recv_splits, kind)
        return all_to_all(x, send_splits, recv_splits, hop.group)

    @staticmethod
    def backward(ctx, grad):
        ctx.hop.count(ctx.stats, grad, ctx.recv_splits, ctx.send_splits, "gradients" if ctx.kind == "rows" else "bytes")
        return all_to_all(grad, ctx.recv_splits, ctx.send_splits, ctx.hop.group), None, None, None, None, None


class _SumRows(torch.autograd.Function):
    """out = zeros(n, ...).index_add(0, rows, values); backward gathers the gradient's rows. Saves only `rows`:
    autograd's own index_add keeps `values` too (a [rows, hidden] copy per layer that backward never reads)."""

    @staticmethod
    def forward(ctx, values, rows, n):
        ctx.save_for_backward(rows)
        return values.new_zeros((n, *values.shape[1:])).index_add_(0, rows, values)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        return grad.index_select(0, rows), None, None


def route(x, experts, weights, hops: list[Hop], compute, stats: DispatchStats | None = None) -> torch.Tensor:
    """out [n, H], out_r = sum_j weights[r, j] * expert_{experts[r, j]}(x_r) over the row's assignments (experts
    [n, k] global ids, -1 = none; weights [n, k]), computed where the experts are: through hops[0] each row goes
    once to each member that leads to one of its experts, carrying only those (the rest -1 / 0); the members route
    what they received through the remaining hops, the last calls compute(x, experts, weights) on its own experts'
    rows; each row's results come back through the same hops and are added up."""
    if not hops:
        return compute(x, experts, weights)
    hop = hops[0]
    with torch.no_grad():
        member = hop.member(experts)
        meets = member[:, None, :] == torch.arange(hop.size, device=x.device)[None, :, None]  # [n, size, k]
        destination, rows = meets.any(-1).t().nonzero(as_tuple=True)  # (member, row) pairs, by member then row
        carried = meets[rows, destination]  # [m, k]: the assignments each copy carries
        send_counts = torch.bincount(destination, minlength=hop.size)
        ones = [1] * hop.size
        send, recv = send_counts.tolist(), all_to_all(send_counts, ones, ones, hop.group).tolist()  # one host read
        sent_experts = torch.where(carried, experts.index_select(0, rows), -1)
    sent_weights = torch.where(carried, weights.index_select(0, rows), weights.new_zeros(()))
    # the weights and the ids in one float32 exchange (ids are exact in float32 below 2^24): per hop one count
    # exchange, this, the rows out and the rows back
    meta = _AllToAll.apply(torch.cat([sent_weights.float(), sent_experts.float()], 1), send, recv, hop, stats, "bytes")
    k = experts.shape[1]
    weights_received, experts_received = meta[:, :k].to(weights.dtype), meta[:, k:].detach().long()
    x_received = _AllToAll.apply(x.index_select(0, rows), send, recv, hop, stats, "rows")
    y = route(x_received, experts_received, weights_received, hops[1:], compute, stats)
    back = _AllToAll.apply(y, recv, send, hop, stats, "rows")
    return _SumRows.apply(back, rows, x.shape[0])


class ExpertDispatch:
    """Routes a MoE layer's tokens to the ranks that hold their experts and combines the results (`route`).

    group: a process group of the EP group's ranks, in EP order (rank i of the group holds block i); hops: the
    dispatch's stages (`hops_of`)."""

    def __init__(self, group, ep_size: int, experts_per_rank: int, hops: list[Hop], stats: DispatchStats | None = None):
        self.group, self.ep_size, self.experts_per_rank, self.hops = group, ep_size, experts_per_rank, hops
        self.stats = stats if stats is not None else DispatchStats()

    def __call__(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, local_forward):
        """local_forward(x [n, H], local expert ids [n, k], weights [n, k]) of the experts held here; a padded slot
        has the id one past the last local expert (quant.modules.group_tokens_by_expert leaves it out)."""
        per_rank = self.experts_per_rank

        def held_here(x, experts, weights):
            local = torch.where(experts >= 0, experts % per_rank, per_rank)
            return local_forward(x, local, weights.to(x.dtype))

        self.stats.assignments += top_k_index.numel()
        return route(hidden, top_k_index, top_k_weights, self.hops, held_here, self.stats)

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


def shard_experts(
    model: nn.Module, group, layout: ExpertLayout, rank: int, node_group=None, rail_group=None
) -> DispatchStats:
    """Give every routed-expert module of a model loaded with `experts=layout.experts_of(rank)` its dispatcher
    (one shared DispatchStats; hops_of: the node and rail groups when the layout is hierarchical). Checks that the
    loaded shard is this rank's."""
    stats = DispatchStats()
    mine = layout.experts_of(rank)
    hops = hops_of(layout, rank, group, node_group, rail_group)
    for name, module in model.named_modules():
        if isinstance(module, FrozenExperts):
            held = range(module.first_expert, module.first_expert + module.num_experts)
            if held != mine:
                raise ValueError(
                    f"{name} holds experts {held.start}..{held.stop - 1}; rank {rank} of {layout} owns {mine.start}..{mine.stop - 1}"
                )
            module.dispatch = ExpertDispatch(group, layout.ep_size, layout.experts_per_rank, hops, stats)
    return stats


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed-expert LoRA tensors held per expert (their gradients are summed over the EDP group, not over all
    ranks); the factors a shared_outer layer's experts share are replicated like attention's."""
    from moe_lora.lora_layers import LoRAExperts

    return [p for m in model.modules() if isinstance(m, LoRAExperts) for p in m.per_expert_parameters()]
