"""benchmarks/engine_decode.py on the CPU with the real layout and small widths: it runs end to end, its JSON is what
the plan's fit reads, and its roofline counts the latent a step reads."""

import json

from types import SimpleNamespace

import pytest

from allsync.plan.torch_decode import expected_touched, fit_torch_decode
from benchmarks.engine_decode import kv_bytes_read, main

SMALL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "experts": 16,
    "n_group": 4,
    "topk_group": 2,
}


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_the_benchmark_runs_on_the_cpu_and_its_json_fits_the_plans_model(tmp_path):
    out = tmp_path / "decode.json"
    result = main(
        ["--device", "cpu", "--ckpt", str(tmp_path / "ckpt"), "--rows", "2,4", "--contexts", "8,32", "--steps", "2"]
        + ["--copy-bytes", str(10**7), "--shape", json.dumps(SMALL), "--json", str(out)]
    )
    assert json.loads(out.read_text()) == result
    assert [p["plan"] for p in result["plans"]] == ["nf4", "fp8"]
    for plan in result["plans"]:
        assert [(c["mode"], c["rows"], c["context"]) for c in plan["cases"]] == [
            ("eager", r, c) for r in (2, 4) for c in (8, 32)
        ]
        for case in plan["cases"]:
            assert len(case["layer_ms"]) == 2 and case["step_ms"] >= sum(case["layer_ms"]) > 0
            # what the JSON rounds: tokens_per_s to 0.1, step_ms to 0.001 ms (d(rows / t) = rows dt / t^2)
            rows, step = case["rows"], case["step_ms"]
            rounding = 0.05 + rows * 1000 * 0.0005 / step**2
            assert abs(case["tokens_per_s"] - rows / step * 1000) <= rounding * (1 + 1e-9)
            assert case["roofline_ms"] > 0 and case["over_roofline"] > 0
    rates = fit_torch_decode(result)
    assert [r for r, _ in rates.fixed] == [2, 4] and set(rates.per_expert) == {"nf4", "fp8"}


def test_the_expected_distinct_experts_and_the_latent_bytes_a_step_reads():
    assert expected_touched(256, 8, 1) == pytest.approx(8)
    assert expected_touched(256, 8, 256) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 256))
    config = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=2)
    assert kv_bytes_read(config, 4, 100, 2) == 4 * 100 * 576 * 2 * 2
    assert kv_bytes_read(config, 4, 100, 2, fp8=True) == 4 * 100 * 656 * 2  # 512 FP8 + 4 float32 scales + 64 bf16


def test_the_fixed_shape_step_is_timed_like_the_eager_one(tmp_path):
    """--modes fixed: the engine's fixed-shape step (every slot, routed experts without a host read) on the same
    checkpoint; a graphed step needs --device cuda."""
    result = main(
        ["--device", "cpu", "--ckpt", str(tmp_path / "ckpt"), "--rows", "2", "--contexts", "8", "--steps", "1"]
        + ["--copy-bytes", str(10**6), "--shape", json.dumps(SMALL), "--modes", "fixed", "--plans", "nf4"]
    )
    (case,) = result["plans"][0]["cases"]
    assert case["mode"] == "fixed" and len(case["layer_ms"]) == 2 and case["step_ms"] > 0
    both = main(  # --kv-cache auto,fp8: each mode over both caches
        ["--device", "cpu", "--ckpt", str(tmp_path / "ckpt"), "--rows", "2", "--contexts", "8", "--steps", "1"]
        + ["--copy-bytes", str(10**6), "--shape", json.dumps(SMALL), "--kv-cache", "auto,fp8", "--plans", "nf4"]
    )
    cases = both["plans"][0]["cases"]
    assert [c["kv_cache"] for c in cases] == ["auto", "fp8"] and cases[1]["bytes_read"] < cases[0]["bytes_read"]
    gemm = (
        main(  # --fp8-linear-kernel dequantize,scaled_mm: each case with the FP8 linears dequantized and as FP8 GEMMs
            ["--device", "cpu", "--ckpt", str(tmp_path / "ckpt"), "--rows", "2", "--contexts", "8", "--steps", "1"]
            + ["--copy-bytes", str(10**6), "--shape", json.dumps(SMALL), "--modes", "fixed", "--plans", "nf4"]
            + ["--fp8-linear-kernel", "dequantize,scaled_mm"]
        )
    )
    cases = gemm["plans"][0]["cases"]
    assert [c.get("fp8_linear_kernel") for c in cases] == [None, "scaled_mm"] and cases[1]["step_ms"] > 0
    with pytest.raises(SystemExit, match="--fp8-linear-kernel: use dequantize, scaled_mm"):
        main(["--device", "cpu", "--ckpt", str(tmp_path / "refused"), "--fp8-linear-kernel", "fp8"])
    for bad in ("24x32x8", "16x32", "16xax8"):  # the latent kernel's cuts: powers of two, all three given
        with pytest.raises(SystemExit, match="--attention-blocks"):
            main(["--device", "cpu", "--ckpt", str(tmp_path / "refused"), "--attention-blocks", bad])
    for bad in ("24x64x4x3", "64x64x4", "64x16x4x3"):  # the NF4 expert kernel's cuts: four numbers it can run
        with pytest.raises(SystemExit, match="--expert-blocks"):
            main(["--device", "cpu", "--ckpt", str(tmp_path / "refused"), "--expert-blocks", bad])
    assert not (tmp_path / "refused").exists()
    with pytest.raises(SystemExit, match="--modes graphed: CUDA graphs need --device cuda"):
        main(["--device", "cpu", "--modes", "graphed"])
    with pytest.raises(SystemExit, match="--attention/--expert-kernel triton: Triton needs --device cuda"):
        main(["--device", "cpu", "--attention", "torch,triton"])
    with pytest.raises(SystemExit, match="--attention/--expert-kernel triton: Triton needs --device cuda"):
        main(["--device", "cpu", "--expert-kernel", "triton"])
    with pytest.raises(SystemExit, match="--attention: use torch, triton"):
        main(["--device", "cpu", "--attention", "flash"])
