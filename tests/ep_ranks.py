"""What each spawned rank of the expert-parallel tests runs (importable by torch.multiprocessing's spawn).

A case: E routed experts, tokens of every rank with their routing, a random output gradient. Rank r
computes its tokens' output with its expert shard and the all-to-all dispatch, backpropagates, sums the
expert-adapter gradients over its EDP group (unless the negative control skips it), and reports output,
input/router-weight gradients and its LoRA gradients (global expert ids) for the parent to compare with
the single-process reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_lora.lora import seeded_init_
from moe_lora.lora_layers import LoRAExperts
from quant.formats import quantize_weight
from quant.modules import EXPERT_PROJECTIONS, FrozenExperts

HIDDEN, INTER, RANK, TOP_K = 32, 16, 4, 2


@dataclass
class Case:
    num_experts: int
    tokens_per_rank: list[int]
    fmt: str
    seed: int = 0
    idle_positions: tuple[int, ...] = ()  # EP positions whose experts no token is routed to
    kernel: str = "loop"  # LoRAExperts' routed-expert kernel on every rank (the reference always uses the loop)

    def routing(self, rank: int, ep_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H], top_k_index [T, k], top_k_weights [T, k], output gradient [T, H] of one rank's tokens."""
        gen = torch.Generator().manual_seed(1000 * self.seed + rank)
        t = self.tokens_per_rank[rank]
        per_rank = self.num_experts // ep_size
        allowed = torch.tensor([e for e in range(self.num_experts) if e // per_rank not in self.idle_positions])
        scores = torch.rand(t, len(allowed), generator=gen)
        index = allowed[scores.topk(TOP_K, dim=-1).indices]
        weights = torch.rand(t, TOP_K, generator=gen)
        return torch.randn(t, HIDDEN, generator=gen), index, weights, torch.randn(t, HIDDEN, generator=gen)


def experts_module(case: Case, experts: range, kernel: str = "loop") -> LoRAExperts:
    """Experts `experts` of the case's model (same frozen weights and adapter whatever the shard)."""
    base = FrozenExperts(len(experts), HIDDEN, INTER, first_expert=experts.start)
    gen = torch.Generator().manual_seed(case.seed)
    shapes = {"gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}
    for e in range(case.num_experts):
        for p in EXPERT_PROJECTIONS:
            w = torch.randn(*shapes[p], generator=gen) / shapes[p][1] ** 0.5
            if e in experts:
                base.set_weight(e - experts.start, p, quantize_weight(w, case.fmt))
    module = LoRAExperts(base, RANK, scale=2.0, kernel=kernel)
    holder = torch.nn.Module()
    holder.add_module("experts", module)
    seeded_init_(holder, case.seed)
    with torch.no_grad():
        for p in EXPERT_PROJECTIONS:  # B nonzero, the same per global expert whatever the shard
            for e in experts:
                g = torch.Generator().manual_seed(case.seed * 7919 + e * 3 + EXPERT_PROJECTIONS.index(p))
                module.lora_B[p][e - experts.start].normal_(0, 0.1, generator=g)
    return module


def lora_grads(module: LoRAExperts) -> dict[str, torch.Tensor]:
    """{'gate.A.5': grad of expert 5's A_gate, ...} under global expert ids."""
    out = {}
    for p in EXPERT_PROJECTIONS:
        for name, param in (("A", module.lora_A[p]), ("B", module.lora_B[p])):
            for i in range(module.num_experts):
                out[f"{p}.{name}.{module.first_expert + i}"] = param.grad[i].clone()
    return out


def run_rank(
    rank: int,
    world_size: int,
    ep_size: int,
    address: str,
    case: Case,
    reduce_edp: bool,
    results,
    ranks_per_node: int | None = None,
) -> None:
    from allsync.distributed.process_groups import connect
    from moe_lora.expert_parallel import ExpertLayout, shard_experts

    torch.set_num_threads(1)
    layout = ExpertLayout(world_size, ep_size, case.num_experts, ranks_per_node)
    groups = connect(rank, world_size, address, "gloo", layout)
    module = experts_module(case, layout.experts_of(rank), case.kernel)
    stats = shard_experts(module, groups.ep, layout, rank, groups.node, groups.rail)
    x, index, weights, grad_out = case.routing(rank, ep_size)
    x.requires_grad_(True)
    weights.requires_grad_(True)
    out = module(x, index, weights)
    (out * grad_out).sum().backward()
    for p in module.adapter_parameters():
        if reduce_edp:
            groups.all_reduce(p.grad, "edp")
    results[rank] = {
        "out": out.detach(),
        "dx": x.grad,
        "dw": weights.grad,
        "lora": lora_grads(module),
        "moved": stats.take(),
    }


# ------------------------------------------------------------------------------------------ whole model
SEQ_LEN = 10


def model_tokens(rank: int, batch: int) -> torch.Tensor:
    return torch.randint(8, 250, (batch, SEQ_LEN), generator=torch.Generator().manual_seed(50 + rank))


def model_grad_out(rank: int, batch: int, vocab: int) -> torch.Tensor:
    return torch.randn(batch, SEQ_LEN, vocab, generator=torch.Generator().manual_seed(90 + rank))


def lora_model(checkpoint, fmt: str, experts: range | None = None):
    """The tiny model with LoRA on every default target, A seeded per PEFT key and B nonzero (seeded per key too),
    holding `experts` (all when None)."""
    import zlib

    from moe_lora.lora import LoRAConfig, _adapter_slots, attach_lora
    from quant.loader import QuantPlan, load_frozen_model

    model = load_frozen_model(
        checkpoint, QuantPlan(routed_experts=fmt), compute_dtype=torch.float32, progress=False, experts=experts
    )
    attach_lora(model, LoRAConfig(rank=4, alpha=8))
    seeded_init_(model, 0)
    with torch.no_grad():
        for key, slot in _adapter_slots(model).items():
            if ".lora_B." in key:
                slot.normal_(0, 0.05, generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))
    return model


def model_lora_grads(model) -> dict[str, torch.Tensor]:
    """PEFT key -> gradient of that adapter tensor (global expert ids)."""
    from moe_lora.lora import PEFT_PREFIX, LoRALinear, expert_slots

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            out[f"{PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A.grad.clone()
            out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B.grad.clone()
        elif isinstance(m, LoRAExperts):
            out.update(
                {
                    k: v.clone()
                    for k, v in expert_slots(
                        PEFT_PREFIX + name, [p.grad for p in m.adapter_parameters()], m.first_expert
                    ).items()
                }
            )
    return out


def run_model_rank(
    rank: int, world_size: int, ep_size: int, address: str, checkpoint: str, fmt: str, batches: list[int], results
) -> None:
    """Rank `rank` of the whole tiny model under EP: logits of its own sequences, then every LoRA gradient
    after the loop's reductions (replicated tensors over all ranks, expert blocks over the EDP group)."""
    from allsync.distributed.process_groups import connect
    from moe_lora.expert_parallel import ExpertLayout, expert_parameters, shard_experts
    from quant.checkpoint_io import read_config

    torch.set_num_threads(1)
    layout = ExpertLayout(world_size, ep_size, read_config(checkpoint)["n_routed_experts"])
    groups = connect(rank, world_size, address, "gloo", layout)
    model = lora_model(checkpoint, fmt, layout.experts_of(rank))
    shard_experts(model, groups.ep, layout, rank)
    logits = model(input_ids=model_tokens(rank, batches[rank])).logits
    (logits * model_grad_out(rank, batches[rank], logits.shape[-1])).sum().backward()
    sharded = {id(p) for p in expert_parameters(model)}
    for p in model.parameters():
        if p.requires_grad:
            groups.all_reduce(p.grad, "edp" if id(p) in sharded else "world")
    results[rank] = {"logits": logits.detach(), "grads": model_lora_grads(model)}


def run_saved_bytes_rank(
    rank: int, world_size: int, ep_size: int, address: str, checkpoint: str, tokens: int, results
) -> None:
    """Rank `rank` of the tiny model under EP, bf16 compute, LoRA on every default target: the bytes the trainer's
    forward of `tokens` tokens saves for backward on this rank (allsync.plan.activations.saved_per_layer), routed
    tokens dispatched to the ranks holding their experts."""
    from allsync.distributed.process_groups import connect
    from allsync.plan.activations import saved_per_layer
    from moe_lora.expert_parallel import ExpertLayout, shard_experts
    from moe_lora.lora import LoRAConfig, attach_lora
    from quant.checkpoint_io import read_config
    from quant.loader import QuantPlan, load_frozen_model

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    layout = ExpertLayout(world_size, ep_size, read_config(checkpoint)["n_routed_experts"])
    groups = connect(rank, world_size, address, "gloo", layout)
    model = load_frozen_model(
        checkpoint,
        QuantPlan.uniform("bf16"),
        compute_dtype=torch.bfloat16,
        progress=False,
        experts=layout.experts_of(rank),
    )
    attach_lora(model, LoRAConfig(rank=4, alpha=8))
    shard_experts(model, groups.ep, layout, rank)
    results[rank] = sum(saved_per_layer(model, tokens, checkpointing=False).values())


def run_decode_rank(
    rank: int, world_size: int, address: str, checkpoint: str, fmt: str, cases: list, sampling, eos: int, results
) -> None:
    """Rank `rank` of the tiny model at EP = world_size decoding its rows of each case (rows, seeds per rank) in 3 KV
    slots in lockstep, with the live-slot step, with the fixed-shape step and with the fixed-shape step over 4 shared
    pages: (tokens, logprobs, reasons) of each."""
    from allsync.engines.slots import FixedShapeStep, decode_in_slots
    from allsync.distributed.process_groups import connect
    from moe_lora.expert_parallel import ExpertLayout, shard_experts
    from moe_lora.mla_decode import install_mla_decode
    from quant.checkpoint_io import read_config

    torch.set_num_threads(1)
    layout = ExpertLayout(world_size, world_size, read_config(checkpoint)["n_routed_experts"])
    groups = connect(rank, world_size, address, "gloo", layout)
    model = lora_model(checkpoint, fmt, layout.experts_of(rank))
    shard_experts(model, groups.ep, layout, rank)
    install_mla_decode(model)
    model.eval()
    for i, (rows, seeds) in enumerate(cases):
        for fixed in (None, FixedShapeStep):
            out = decode_in_slots(model, rows[rank], seeds[rank], sampling, eos, 2, 3, True, groups, fixed_step=fixed)
            results[(rank, i, fixed is not None)] = (out.tokens, out.logprobs, out.reasons)
        # fixed-shape steps over 4 shared pages (rollout.kv_cache_tokens): two rows at a time on a rank
        out = decode_in_slots(
            model, rows[rank], seeds[rank], sampling, eos, 2, 3, True, groups, fixed_step=FixedShapeStep, pages=4
        )
        results[(rank, i, "paged")] = (out.tokens, out.logprobs, out.reasons)
