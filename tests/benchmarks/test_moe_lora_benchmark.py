"""benchmarks/moe_lora.py: the --quick run prints every row and the summary line; its memory probe measures."""

import json
import re

import torch

from benchmarks import moe_lora as bench

SUMMARY = re.compile(r"^worst ours/base: time (\d+\.\d\d)x, memory (\d+\.\d\d)x$")


def test_quick_benchmark_table(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    rows = bench.main(["--quick", "--json", str(out_json)])
    lines = capsys.readouterr().out.strip().splitlines()

    spec = bench.BenchSpec(**bench.QUICK)
    expected = {(e, f, v) for e in spec.experts for f in spec.formats for v in ("base", "ours")}
    expected |= {(e, "bf16", "peft") for e in spec.experts}
    assert {(r.experts, r.format, r.variant) for r in rows} == expected
    for r in rows:
        assert r.time_ms > 0 and r.peak_mib > 0, r
        assert r.time_vs_base > 0 and r.mem_vs_base > 0, r
        table_line = next(line for line in lines if line.split()[:3] == [str(r.experts), r.format, r.variant])
        assert f"{r.time_ms:.1f}" in table_line and f"{r.peak_mib:.1f}" in table_line

    match = SUMMARY.match(lines[-1])
    assert match, lines[-1]
    worst_time, worst_mem = float(match.group(1)), float(match.group(2))
    ours = [r for r in rows if r.variant == "ours"]
    assert worst_time == round(max(r.time_vs_base for r in ours), 2) > 0
    assert worst_mem == round(max(r.mem_vs_base for r in ours), 2) > 0

    saved = json.loads(out_json.read_text())
    assert len(saved["rows"]) == len(rows)
    assert saved["worst_ours_vs_base"]["memory"] == max(r.mem_vs_base for r in ours)


def test_cpu_peak_probe_counts_live_bytes():
    """4 MB then 8 MB while the first is alive -> 12 MB; a later 8 MB after freeing both does not add."""

    def run():
        a = torch.empty(1 << 20, dtype=torch.float32)
        b = torch.empty(2 << 20, dtype=torch.float32)
        del a, b
        c = torch.empty(2 << 20, dtype=torch.float32)
        del c

    assert bench.cpu_step_peak_bytes(run) == 12 << 20


def test_the_shared_outer_rows_hold_less_than_the_per_expert_ones(capsys):
    """--layouts per_expert,shared_outer: a row per layout; shared_outer's adapter and its gradients are smaller, so
    its peak is below per_expert's at the same frozen experts."""
    rows = bench.main(["--quick", "--formats", "nf4", "--experts", "16", "--layouts", "per_expert,shared_outer"])
    by_variant = {r.variant: r for r in rows}
    assert set(by_variant) == {"base", "ours", "ours[shared_outer]"}
    assert by_variant["ours[shared_outer]"].peak_mib < by_variant["ours"].peak_mib
    assert "ours[shared_outer]" in capsys.readouterr().out
