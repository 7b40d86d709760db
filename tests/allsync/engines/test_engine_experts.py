"""Which experts' LoRA each rank of a vLLM engine over all the workers serves, and the transfer from the trainer rank
that trains them (allsync/engines/engine_experts.py), against the two layouts' own definitions."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from allsync.engines.engine_experts import (
    block_sources,
    engine_block,
    exchange_engine_blocks,
    renamed_experts,
    vllm_lora_names,
)
from allsync.launch.group import free_port
from moe_lora.expert_parallel import ExpertLayout

PREFIX = "base_model.model.model.layers.1.mlp"


@pytest.mark.parametrize(("experts", "world"), [(192, 48), (256, 48), (5, 2), (8, 3), (4, 4)])
def test_engine_blocks_are_vllms_linear_placement(experts, world):
    """Contiguous blocks in rank order covering every expert once, the first E mod W ranks one expert more (256 over
    48: 16 ranks of 6, then 32 of 5), E / W each where they split evenly."""
    blocks = [engine_block(r, world, experts) for r in range(world)]
    assert [e for b in blocks for e in b] == list(range(experts))
    base, extra = divmod(experts, world)
    assert [len(b) for b in blocks] == [base + 1] * extra + [base] * (world - extra)
    if experts == 256:
        assert blocks[15] == range(90, 96) and blocks[16] == range(96, 101)


@pytest.mark.slow  # vLLM's import (~15 s)
@pytest.mark.vllm
@pytest.mark.parametrize(("experts", "world"), [(256, 48), (5, 2), (8, 3), (192, 48)])
def test_engine_blocks_are_the_experts_vllm_maps_to_each_rank(experts, world):
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    for rank in range(world):
        _, expert_map, _ = determine_expert_map(world, rank, experts)
        held = [e for e in range(experts) if expert_map[e] >= 0]
        assert held == list(engine_block(rank, world, experts))
        assert [int(expert_map[e]) for e in held] == list(range(len(held)))


@pytest.mark.parametrize(
    ("world", "trainer_ep", "experts"), [(4, 1, 192), (4, 2, 192), (4, 4, 192), (48, 16, 256), (6, 3, 192), (4, 2, 6)]
)
def test_every_engine_expert_comes_from_the_rank_of_its_ep_group_that_trains_it(world, trainer_ep, experts):
    layout = ExpertLayout(world, trainer_ep, experts)
    for rank in range(world):
        sources = block_sources(rank, world, trainer_ep, experts)
        assert [e for held in sources.values() for e in held] == list(engine_block(rank, world, experts))
        for source, held in sources.items():
            trained = layout.experts_of(source)
            assert held.start >= trained.start and held.stop <= trained.stop
            assert source in layout.ep_group(rank)
    if (world, trainer_ep, experts) == (48, 16, 256):  # rank 2's 6 experts (12-17) span trainer ranks 0 and 1
        assert block_sources(2, 48, 16, 256) == {0: range(12, 16), 1: range(16, 18)}


def test_matching_layouts_and_replicated_experts_need_no_transfer():
    assert all(list(block_sources(r, 8, 8, 64)) == [r] for r in range(8))
    assert all(list(block_sources(r, 8, 1, 64)) == [r] for r in range(8))
    assert all(list(block_sources(r, 48, 1, 256)) == [r] for r in range(48))


def test_held_experts_go_where_vllms_lora_path_reads_them():
    """vLLM 0.32 reads rank r's expert LoRA at [r L, (r + 1) L) of the adapter: the identity where the experts split
    evenly; with 5 over 2, rank 1's experts 3 and 4 under 2 and 3; other keys unchanged."""
    assert all(vllm_lora_names(r, 4, 8) == {e: e for e in engine_block(r, 4, 8)} for r in range(4))
    assert vllm_lora_names(0, 2, 5) == {0: 0, 1: 1, 2: 2} and vllm_lora_names(1, 2, 5) == {3: 2, 4: 3}
    tensors = expert_tensors(range(3, 5))
    renamed = renamed_experts(tensors, vllm_lora_names(1, 2, 5))
    assert (
        renamed[f"{PREFIX}.experts.2.gate_proj.lora_A.weight"] is tensors[f"{PREFIX}.experts.3.gate_proj.lora_A.weight"]
    )
    assert (
        renamed[f"{PREFIX}.experts.3.down_proj.lora_B.weight"] is tensors[f"{PREFIX}.experts.4.down_proj.lora_B.weight"]
    )
    assert len(renamed) == len(tensors) and "base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight" in renamed


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


@pytest.mark.parametrize("experts", [8, 6])
def test_four_ranks_serving_quarters_of_a_trainer_split_in_halves_receive_their_experts(experts):
    """W 4, trainer EP 2. 8 experts: ranks 1 and 2 get their engine blocks (experts 2-3, 4-5) from the rank of their
    EP group that trains them (0 and 3); ranks 0 and 3 hold theirs. 6 experts (blocks 2, 2, 1, 1: uneven): rank 1's
    block (2-3) comes from rank 0 (expert 2) and itself (3), rank 2's (4) from rank 3."""
    world, trainer_ep = 4, 2
    results = mp.Manager().dict()
    mp.spawn(exchange_rank, (world, trainer_ep, experts, free_port(), results), nprocs=world)
    for rank in range(world):
        want = expert_tensors(engine_block(rank, world, experts))
        assert sorted(results[rank]) == sorted(want)
        assert all(torch.equal(results[rank][k], want[k]) for k in want)
