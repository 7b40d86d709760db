"""allsync plan's vLLM pricing: the decode factor taken from published DeepSeek-V3 serving runs, the expert-LoRA
share, and vLLM's experts over every GPU (rollout.engine_expert_parallel)."""

from dataclasses import replace

import pytest

from allsync.cli import main
from allsync.config import load_config_for_planning
from allsync.plan.generation import generator_bytes, generator_cost
from allsync.plan.fit import Layout, engine_expert_parallel
from allsync.plan.hardware import GPUS
from allsync.plan.search import not_built
from allsync.plan.shapes import DEEPSEEK_V3
from allsync.plan.vllm_decode import (
    EXPERT_LORA_DECODE_SHARE,
    PUBLISHED,
    published_factor,
    published_factors,
    roofline_step_seconds,
    vllm_decode_factor,
)
from allsync.plan.weights import engine_bytes

CONFIG = "recipes/configs/dapo_math_deepseek_v3_671b.yaml"


def test_each_published_run_is_its_step_over_the_roofline_of_that_step():
    """A run's factor is batch / (tokens/s a GPU) over the plan's roofline at its batch, context and EP; the stated
    runs without MTP are all faster than the roofline (0.58-0.73: it prices decode FLOPs at the training share and
    the expert exchange serially), and the plan takes the slowest of them (LMSYS's 96 H100, 2,785 tokens/s a GPU at
    batch 256, 2K context)."""
    used = published_factors()
    assert {p.tokens_per_second_per_gpu for p, _ in used} == {14800 / 8, 22282 / 8, 18598 / 8, 1850.0}
    for point, factor in used:
        step = point.batch_per_gpu / point.tokens_per_second_per_gpu
        assert factor == pytest.approx(step / roofline_step_seconds(point))
        assert 0.55 < factor < 0.75
    assert vllm_decode_factor() == max(f for _, f in used) == pytest.approx(0.731, abs=0.001)
    lmsys = next(p for p, f in used if f == vllm_decode_factor())
    assert "lmsys.org/blog/2025-05-05-large-scale-ep" in lmsys.source and lmsys.mtp is False
    # vLLM's own figure states neither batch nor context; the MTP run is left out (the loop runs no MTP)
    assert [p for p in PUBLISHED if not p.stated][0].tokens_per_second_per_gpu == 2200.0
    mtp = next(p for p in PUBLISHED if p.mtp)
    assert mtp not in [p for p, _ in used] and published_factor(mtp) < vllm_decode_factor()


def test_vllm_decode_is_the_roofline_times_the_factor_over_the_expert_lora_share():
    """generator_cost gives vLLM's step the factor, over 0.62 where the routed experts carry LoRA; the torch engine's
    step keeps its own pricing (factor 1); --vllm-decode-factor and --expert-lora-share replace the defaults."""
    run, _ = load_config_for_planning(CONFIG)
    hw = GPUS["h100"]
    weights = generator_bytes(DEEPSEEK_V3, 16, True, None)
    cost = generator_cost(run, DEEPSEEK_V3, hw, 16, weights, True)
    assert cost.engine_factor == pytest.approx(vllm_decode_factor() / EXPERT_LORA_DECODE_SHARE)
    plain = replace(cost, engine_factor=1.0)
    assert cost.decode_step_seconds(64, 64 * 6000) == pytest.approx(
        plain.decode_step_seconds(64, 64 * 6000) * vllm_decode_factor() / 0.62
    )
    no_expert_lora = replace(run, lora=replace(run.lora, targets=("q_a_proj", "o_proj")))
    assert generator_cost(no_expert_lora, DEEPSEEK_V3, hw, 16, weights, True).engine_factor == vllm_decode_factor()
    what_if = replace(hw, vllm_decode_factor=0.5, expert_lora_decode_share=0.89)
    assert generator_cost(run, DEEPSEEK_V3, what_if, 16, weights, True).engine_factor == pytest.approx(0.5 / 0.89)
    torch_run = replace(run, rollout=replace(run.rollout, engine="torch"))
    assert generator_cost(torch_run, DEEPSEEK_V3, hw, 16, weights, False).engine_factor == 1.0


def test_the_engine_over_every_gpu_holds_its_share_of_the_experts():
    """With rollout.engine_expert_parallel vLLM's group is every GPU (not the trainer's EP), and the busiest GPU holds
    ceil(256 / GPUs) experts: 8 on 32 GPUs, 6 on 48 (6 or 5, as vLLM places them); vLLM reading the trainer's tensors
    (colocation shared) keeps the trainer's."""
    run, _ = load_config_for_planning(CONFIG)
    wide = replace(run, rollout=replace(run.rollout, engine_expert_parallel=True))
    layout = Layout(32, 16, GPUS["h100"].memory_bytes, "sleep")
    assert engine_expert_parallel(run, layout) == 16 and engine_expert_parallel(wide, layout) == 32
    assert engine_expert_parallel(wide, replace(layout, colocation="shared")) == 16
    per_expert = engine_bytes(DEEPSEEK_V3, 256)["routed_experts"]
    assert engine_bytes(DEEPSEEK_V3, 32)["routed_experts"] == 8 * per_expert
    assert engine_bytes(DEEPSEEK_V3, 48)["routed_experts"] == 6 * per_expert


def test_an_engine_over_48_gpus_is_built_and_only_its_colocation_is_not():
    """vLLM over 48 GPUs (6 or 5 of 256 experts a rank, as vLLM places them) runs in the loop; what the search says it
    lacks asleep is the sleep colocation only."""
    from allsync.plan.schedules import StepTime

    run, _ = load_config_for_planning(CONFIG)
    wide = replace(run, rollout=replace(run.rollout, engine_expert_parallel=True))
    step = StepTime("all-sync", 1.0, 0.0)
    layout = {"gpus": 48, "expert_parallel": 16, "engine_expert_parallel": 48, "colocation": "sleep"}
    assert not_built(wide, step, layout, 8) == [
        "vLLM's level-1 sleep with the trainer's frozen weights in host memory while vLLM generates"
    ]
    assert not_built(wide, step, {**layout, "colocation": "resident"}, 8) == []


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--vllm-decode-factor", "0", "--vllm-decode-factor 0.0: must be > 0"),
        ("--expert-lora-share", "1.5", "--expert-lora-share 1.5: a share of no-LoRA decode, in (0, 1]"),
    ],
)
def test_the_vllm_flags_out_of_range_are_refused(flag, value, message, capsys):
    assert main(["plan", "--config", CONFIG, "--shape", "deepseek-v3", flag, value]) != 0
    assert message in capsys.readouterr().err
