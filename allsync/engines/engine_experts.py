"""Which routed experts' LoRA each worker's share of a vLLM engine over all the workers serves, and where it comes from.

The engine (rollout.engine_expert_parallel) shards the routed experts over all W workers the way vLLM's linear
placement does: engine rank r holds the contiguous block
    engine_block(r) = [r E / W, (r + 1) E / W),
its base weights and the LoRA slots of those experts only (vLLM's LoRA path packs the block ep_rank x E / EP).
The trainer shards them over its expert-parallel groups of k | W ranks (moe_lora.expert_parallel.ExpertLayout): rank
r trains [j E / k, (j + 1) E / k), j = r mod k. E / W divides E / k, so engine block r lies inside the trainer block
j' = floor(r k / W); the rank at that position of r's own EP group holds it:
    block_source(r) = (r // k) k + floor(r k / W).
k = W and k = 1 give r itself (no transfer); otherwise the source sends the block to r, one flat tensor per
destination (`exchange_engine_blocks`), adapter tensors only.
"""

from __future__ import annotations

import re

import torch

from moe_lora.expert_parallel import ExpertLayout

EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.")


def engine_block(rank: int, world: int, num_experts: int) -> range:
    """The trainer's own layout with every rank in one EP group of W (ExpertLayout: E / W experts a rank)."""
    return ExpertLayout(world, world, num_experts).experts_of(rank)


def block_source(rank: int, world: int, trainer_ep: int) -> int:
    """The trainer rank whose experts contain engine rank `rank`'s block (module docstring)."""
    return rank // trainer_ep * trainer_ep + rank * trainer_ep // world


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
    experts of engine_block(rank), received from block_source(rank) when another rank holds them. Every rank must
    call it (a source sends while its destinations receive). `group`: the world's process group (global ranks);
    `device`: where its collectives run (None: where the tensors are). An adapter without routed-expert LoRA moves
    nothing."""
    block = engine_block(rank, world, num_experts)
    templates = sorted({template_of(k) for k in tensors if expert_of(k) is not None})
    out = own_block(tensors, block)
    if not templates:
        return out
    held = next(e for k in tensors if (e := expert_of(k)) is not None)
    like = tensors[templates[0].replace("{}", str(held), 1)]
    device = like.device if device is None else device
    works, sent, received = [], [], None
    for dest in range(world):
        if dest != rank and block_source(dest, world, trainer_ep) == rank:
            keys = block_keys(templates, engine_block(dest, world, num_experts))
            sent.append(torch.cat([tensors[k].reshape(-1) for k in keys]).to(device))
            works.append(group.send([sent[-1]], dest, 0))
    source = block_source(rank, world, trainer_ep)
    if source != rank:
        shapes = [tensors[t.replace("{}", str(held), 1)].shape for t in templates] * len(block)
        received = torch.empty(sum(s.numel() for s in shapes), dtype=like.dtype, device=device)
        works.append(group.recv([received], source, 0))
    for work in works:
        work.wait()
    if received is not None:
        parts = received.to(like.device).split([s.numel() for s in shapes])
        out.update({k: p.view(s) for k, p, s in zip(block_keys(templates, block), parts, shapes)})
    return out
