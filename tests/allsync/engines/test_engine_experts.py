"""Which experts' LoRA each rank of a vLLM engine over all the workers serves, and the transfer from the trainer rank
that trains them (allsync/engines/engine_experts.py), against the two layouts' own definitions."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from allsync.engines.engine_experts import block_source, engine_block, exchange_engine_blocks
from allsync.launch.group import free_port
from moe_lora.expert_parallel import ExpertLayout

PREFIX = "base_model.model.model.layers.1.mlp"


@pytest.mark.parametrize(("world", "trainer_ep"), [(4, 1), (4, 2), (4, 4), (8, 2), (48, 16), (6, 3)])
def test_every_engine_block_lies_in_its_sources_trainer_block_in_the_same_ep_group(world, trainer_ep):
    experts = 48 * 4
    layout = ExpertLayout(world, trainer_ep, experts)
    for rank in range(world):
        source = block_source(rank, world, trainer_ep)
        block, held = engine_block(rank, world, experts), layout.experts_of(source)
        assert block.start >= held.start and block.stop <= held.stop
        assert source in layout.ep_group(rank)
    assert [engine_block(r, world, experts) for r in range(world)] == [
        range(r * experts // world, (r + 1) * experts // world) for r in range(world)
    ]


def test_matching_layouts_and_replicated_experts_need_no_transfer():
    assert all(block_source(r, 8, 8) == r for r in range(8))
    assert all(block_source(r, 8, 1) == r for r in range(8))


def expert_tensors(experts: range) -> dict[str, torch.Tensor]:
    """Each expert's LoRA filled with its index (A [2, 3], B [5, 2] per projection) and one dense module's."""
    tensors = {"base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight": torch.ones(2, 4)}
    for e in experts:
        for proj in ("gate_proj", "down_proj"):
            tensors[f"{PREFIX}.experts.{e}.{proj}.lora_A.weight"] = torch.full((2, 3), float(e))
            tensors[f"{PREFIX}.experts.{e}.{proj}.lora_B.weight"] = torch.full((5, 2), e + 0.5)
    return tensors


def exchange_rank(rank: int, world: int, trainer_ep: int, experts: int, port: int, results) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    held = ExpertLayout(world, trainer_ep, experts).experts_of(rank)
    got = exchange_engine_blocks(expert_tensors(held), rank, world, trainer_ep, experts, dist.group.WORLD)
    results[rank] = {k: v.clone() for k, v in got.items()}
    dist.destroy_process_group()


def test_four_ranks_serving_quarters_of_a_trainer_split_in_halves_receive_their_experts():
    """W 4, trainer EP 2, 8 experts: ranks 1 and 2 get their engine blocks (experts 2-3, 4-5) from the rank of their
    EP group that trains them (0 and 3); ranks 0 and 3 hold theirs."""
    world, trainer_ep, experts = 4, 2, 8
    results = mp.Manager().dict()
    mp.spawn(exchange_rank, (world, trainer_ep, experts, free_port(), results), nprocs=world)
    for rank in range(world):
        want = expert_tensors(engine_block(rank, world, experts))
        assert sorted(results[rank]) == sorted(want)
        assert all(torch.equal(results[rank][k], want[k]) for k in want)
