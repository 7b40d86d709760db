"""benchmarks/plan_levers.py: the 671B step lever by lever, each stage a plan of the one before plus one setting."""

import json

import pytest

from benchmarks.plan_levers import STAGES, WHAT_NEXT, main


def test_each_stage_adds_its_lever_and_the_waterfall_is_written(tmp_path):
    """One draw on 48 H100: every stage priced; balancing the ranks and old logprobs from the engine shorten only the
    train phase; the torch engine's decode levers move only generation, each the way the H200 measured its graphed
    steps (allsync.plan.torch_decode.GRAPHED_H200): the latent kernel and sharing the room in pages (64 slots) shorten
    it, and so do 128 slots in the same room and FP8 GEMMs for the FP8 linears; the FP8 KV cache (read back through bf16 by the torch path) and the NF4 expert kernel (far from its roofline)
    lengthen it; the FP8 KV cache also brings the old-logprob forward back (the engine then samples from the rounded
    cache: algorithm.old_logprobs engine is refused); FP8 KV and shared-outer LoRA give more KV slots inside the
    margin (16 -> 29 -> 34); the shipped vLLM layout does not fit at the margin, the torch engine's layouts do."""
    out, png = tmp_path / "levers.json", tmp_path / "levers.png"
    result = main(["--gpus", "48", "--seeds", "1", "--json", str(out), "--png", str(png)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result)) and png.stat().st_size > 10_000
    stages = {s["stage"]: s for s in result["stages"]["48"]}
    assert list(stages) == [name for name, _, _ in STAGES]
    assert not stages["shipped"]["fits"] and stages["FP8 KV"]["fits"] and stages["torch engine"]["fits"]
    for before, after, part, shorter in (
        ("shipped", "balanced", "train", True),
        ("torch engine", "engine logprobs", "train", True),
        ("shared-outer LoRA", "latent kernel", "generate", True),  # each slot reads its own FP8 positions, once
        ("streamed rounds", "paged KV", "generate", True),  # 64 slots share the room of 34 full-length rows
        ("paged KV", "128 slots", "generate", True),  # a step's weights read for twice the rows
        ("128 slots", "FP8 GEMMs", "generate", True),  # the FP8 linears read as stored, without their copies
        ("FP8 GEMMs", "expert kernel", "generate", False),  # the NF4 experts read once, by a slow kernel
    ):
        other = "generate" if part == "train" else "train"
        assert (stages[after]["parts"][part] < stages[before]["parts"][part]) == shorter
        assert stages[after]["parts"][other] == pytest.approx(stages[before]["parts"][other])
    # FP8 KV: more slots, but the FP8 latent read back through bf16, and the old logprobs recomputed again
    fp8 = stages["FP8 KV"]
    assert fp8["parts"]["generate"] > stages["engine logprobs"]["parts"]["generate"]
    assert fp8["parts"]["train"] == pytest.approx(stages["torch engine"]["parts"]["train"])
    assert fp8["parts"]["train"] > stages["engine logprobs"]["parts"]["train"]
    slots = [stages[name]["decode_batch"] for name in ("engine logprobs", "FP8 KV", "shared-outer LoRA")]
    assert slots == [16, 29, 34]  # FP8 KV: more slots in the same room; shared-outer LoRA: more room
    paged = stages["paged KV"]
    assert paged["decode_batch"] == 64 and paged["kv_cache_tokens"] % 64 == 0 and paged["fits"]
    assert stages["streamed rounds"]["kv_cache_tokens"] is None
    assert (
        stages["128 slots"]["decode_batch"] == 128
        and stages["128 slots"]["kv_cache_tokens"] == paged["kv_cache_tokens"]
    )
    # what the next lever would need, priced on the last stage's layout: faster kernels shorten generation only, each
    # what-if shorter than the one before, the bound (both kernels at their roofline) the shortest
    after = result["what_next"]["48"]
    assert [a["stage"] for a in after] == [label for label, _, _ in WHAT_NEXT]
    last = stages["expert kernel"]
    times = [last["step_seconds"]] + [a["step_seconds"] for a in after]
    assert times == sorted(times, reverse=True) and len(set(times)) == len(times)
    for a in after:
        assert a["parts"]["train"] == pytest.approx(last["parts"]["train"]) and a["decode_batch"] == 128
    with pytest.raises(SystemExit):
        main(["--seeds", "0"])
