"""benchmarks/update_balance.py: the lockstep positions of both packings are what the forwards pad to, and the run
spawns real expert-parallel ranks."""

import pytest

from benchmarks.update_balance import in_row_order, lockstep_positions, main, padded, positions_report, rank_lengths
from allsync.update.sequences import token_budget_chunks


def test_positions_count_the_padding_and_the_group_waits_for_the_largest_forward():
    assert in_row_order([5, 3, 9, 2], 10) == [[0, 1], [2], [3]] and in_row_order([3, 3, 2], 9) == [[0, 1, 2]]
    assert token_budget_chunks([5, 3, 9, 2], 10) == [[2], [0, 1], [3]]  # longest first: 9, then 5 + 3 (10), then 2
    assert padded([5, 3, 9, 2], [[2], [0, 1], [3]]) == [9, 10, 2]
    assert lockstep_positions([[9, 5, 6], [4, 8]]) == 9 + 8 + 6
    report = positions_report(4, 24, 384)
    for name in ("row order", "longest first"):
        r = report[name]
        assert all(p >= t for p, t in zip(r["padded"], report["tokens"])) and r["lockstep"] >= max(r["padded"])
    assert report["longest first"]["lockstep"] < report["row order"]["lockstep"]
    assert sum(report["longest first"]["padded"]) < sum(report["row order"]["padded"])
    assert rank_lengths(0, 5) == rank_lengths(0, 5) != rank_lengths(1, 5)


@pytest.mark.slow  # 9 s; the exchange itself is in the default run: test_balanced_ranks_make_the_one_worker_update...
def test_the_benchmark_runs_two_ranks(tmp_path):
    out = main(["--ep", "2", "--rows", "4", "--repeats", "1", "--json", str(tmp_path / "balance.json")])
    result = out["ep"]["2"]
    assert result["row order"]["wall_seconds"] > 0 and result["longest first"]["wall_seconds"] > 0
    assert (tmp_path / "balance.json").exists()
