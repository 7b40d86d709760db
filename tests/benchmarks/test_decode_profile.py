"""benchmarks/decode_profile.py on the CPU with the real layout and small widths: the fixed-shape step runs under the
profiler, its operators are listed by time per step (largest first, shares of the whole), and bad flags are refused."""

import json

import pytest

from benchmarks.decode_profile import main
from tests.benchmarks.test_engine_decode import SMALL


def test_the_profile_lists_the_steps_operators_by_their_time(tmp_path):
    out = tmp_path / "profile.json"
    args = ["--device", "cpu", "--ckpt", str(tmp_path / "ckpt"), "--cases", "2x8,4x16", "--steps", "2", "--top", "6"]
    result = main(args + ["--shape", json.dumps(SMALL), "--json", str(out)])
    assert json.loads(out.read_text()) == result and result["device"] == "cpu"
    assert [(c["rows"], c["context"]) for c in result["cases"]] == [(2, 8), (4, 16)]
    for case in result["cases"]:
        rows = case["operators"]
        assert len(rows) == 6 and case["kernels"] == []  # no GPU kernels on the CPU
        times = [r["ms_per_step"] for r in rows]
        assert times == sorted(times, reverse=True) and times[0] > 0
        assert all(r["name"].startswith("aten::") and 0 < r["share"] <= 1 for r in rows)
        assert sum(r["share"] for r in rows) <= 1 + 1e-6 and case["kernel_ms_per_step"] >= sum(times) - 1e-3


@pytest.mark.parametrize(
    "args, message",
    [(["--cases", "32"], "--cases"), (["--cases", "0x8"], "--cases"), (["--steps", "0"], "--steps")],
)
def test_bad_flags_are_refused_before_any_work(args, message, tmp_path):
    with pytest.raises(SystemExit) as refused:
        main(["--device", "cpu", "--ckpt", str(tmp_path / "ckpt")] + args)
    assert str(refused.value.code).startswith(message) and not (tmp_path / "ckpt").exists()
