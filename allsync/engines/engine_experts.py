"""Which routed experts' LoRA each worker's share of a vLLM engine over all the workers serves, and where it comes from.

The engine (rollout.engine_expert_parallel) shards the routed experts over all W workers as vLLM's linear placement
does (vllm.model_executor.layers.fused_moe.expert_map_manager.determine_expert_map): with b = E // W and
m = E mod W, engine rank r holds the contiguous block
    engine_block(r) = [r b + min(r, m), r b + min(r, m) + b + [r < m]),
E / W experts each when they split evenly, else b + 1 on the first m ranks and b on the others (256 over 48: 6 or 5),
its base weights and the LoRA slots of those experts only.
The trainer shards them over its expert-parallel groups of k ranks (moe_lora.expert_parallel.ExpertLayout; k divides
E and W): rank r trains [j E / k, (j + 1) E / k), j = r mod k. Expert e of r's engine block is trained at position
floor(e k / E) of every EP group; r takes it from its own group:
    expert_source(r, e) = (r // k) k + floor(e k / E).
k = W and k = 1 give r itself (no transfer); otherwise each source sends each destination its experts of the
destination's block as one flat tensor (`exchange_engine_blocks`), adapter tensors only (an engine block that spans
two trainer blocks, as with uneven blocks, comes from two sources).

vLLM 0.32's LoRA path looks for engine rank r's experts at [r L, (r + 1) L) of the adapter, L its local expert count
(lora/model_manager.py, _restrict_to_local_experts and _slice_moe_lora_ep), which is its block only when the experts
split evenly; `vllm_lora_names` gives each held expert the index vLLM reads it under (docs/vllm-dp-moe-lora.md).
"""

from __future__ import annotations

import re

import torch

EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def engine_block(rank: int, world: int, num_experts: int) -> range:
    """Engine rank `rank`'s experts under vLLM's linear placement over `world` ranks (module docstring)."""
    base, extra = divmod(num_experts, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def expert_source(rank: int, expert: int, trainer_ep: int, num_experts: int) -> int:
    """The rank of `rank`'s trainer EP group that trains `expert` (module docstring)."""
    return rank // trainer_ep * trainer_ep + expert * trainer_ep // num_experts


def block_sources(rank: int, world: int, trainer_ep: int, num_experts: int) -> dict[int, range]:
    """{source rank: the experts of engine_block(rank) it trains}: one source, or two where the block spans two
    trainer blocks."""
    block = engine_block(rank, world, num_experts)
    out: dict[int, list[int]] = {}
    for e in block:
        out.setdefault(expert_source(rank, e, trainer_ep, num_experts), []).append(e)
    return {source: range(held[0], held[-1] + 1) for source, held in out.items()}


def vllm_lora_names(rank: int, world: int, num_experts: int) -> dict[int, int]:
    """{expert of engine_block(rank): the index vLLM 0.32's LoRA path reads it under}: rank x len(block) + i for the
    block's i-th expert (module docstring); the identity where the experts split evenly."""
    block = engine_block(rank, world, num_experts)
    return {e: rank * len(block) + i for i, e in enumerate(block)}


def renamed_experts(tensors: dict[str, torch.Tensor], names: dict[int, int]) -> dict[str, torch.Tensor]:
    """`tensors` with each routed expert's keys under its index in `names` (experts not in it unchanged)."""
    out = {}
    for key, value in tensors.items():
        e = expert_of(key)
        out[key if e is None or e not in names else EXPERT.sub(f".mlp.experts.{names[e]}.", key, count=1)] = value
    return out


def expert_of(key: str) -> int | None:
    match = EXPERT.search(key)
    return int(match.group(1)) if match else None


def template_of(key: str) -> str:
    """The key with its expert index as `{}` (the same projection of every expert)."""
    return EXPERT.sub(".mlp.experts.{}.", key, count=1)


def block_keys(templates: list[str], block: range) -> list[str]:
    """Every expert key of `block`, expert-major, in the order both sides of a transfer use."""
    return [t.replace("{}", str(e), 1) for e in block for t in templates]


def own_block(tensors: dict[str, torch.Tensor], block: range) -> dict[str, torch.Tensor]:
    """The tensors outside the routed experts, and those of the experts in `block`."""
    return {k: v for k, v in tensors.items() if (e := expert_of(k)) is None or e in block}


def exchange_engine_blocks(
    tensors: dict[str, torch.Tensor], rank: int, world: int, trainer_ep: int, num_experts: int, group, device=None
) -> dict[str, torch.Tensor]:
    """This rank's adapter tensors for its engine block: the tensors outside the routed experts, and the LoRA of the
    experts of engine_block(rank), received from the ranks of its EP group that train them (block_sources) where
    another rank does. Every rank must call it (a source sends while its destinations receive). `group`: the world's
    process group (global ranks); `device`: where its collectives run (None: where the tensors are). An adapter
    without routed-expert LoRA moves nothing."""
    block = engine_block(rank, world, num_experts)
    templates = sorted({template_of(k) for k in tensors if expert_of(k) is not None})
    out = own_block(tensors, block)
    if not templates:
        return out
    held = next(e for k in tensors if (e := expert_of(k)) is not None)
    like = tensors[templates[0].replace("{}", str(held), 1)]
    shapes = [tensors[t.replace("{}", str(held), 1)].shape for t in templates]
    device = like.device if device is None else device
    works, sent, received = [], [], []
    for dest in range(world):
        experts = block_sources(dest, world, trainer_ep, num_experts).get(rank) if dest != rank else None
        if experts:
            sent.append(torch.cat([tensors[k].reshape(-1) for k in block_keys(templates, experts)]).to(device))
            works.append(group.send([sent[-1]], dest, 0))
    for source, experts in block_sources(rank, world, trainer_ep, num_experts).items():
        if source != rank:
            size = len(experts) * sum(s.numel() for s in shapes)
            received.append((experts, torch.empty(size, dtype=like.dtype, device=device)))
            works.append(group.recv([received[-1][1]], source, 0))
    for work in works:
        work.wait()
    for experts, flat in received:
        parts = flat.to(like.device).split([s.numel() for s in shapes] * len(experts))
        out.update({k: p.view(s) for k, p, s in zip(block_keys(templates, experts), parts, shapes * len(experts))})
    return out
