"""metrics.jsonl survives a run killed mid-line; busy time leaves out collective waits."""

import json

import pytest

from allsync.metrics import MetricsLog, read_records
from allsync.monitor import Timeline


def test_a_torn_last_line_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "reward": s / 10}) for s in range(4)]
    path.write_text("\n".join(lines) + "\n" + '{"step": 4, "rew')  # SIGKILL while writing step 4
    log = MetricsLog(tmp_path, resume_step=2)
    log.write(3, {"reward": 0.35})
    log.close()
    assert [(r["step"], r["reward"]) for r in read_records(path)] == [(0, 0.0), (1, 0.1), (2, 0.2), (3, 0.35)]


def test_a_bad_line_before_the_last_is_an_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1, oops}\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON line"):
        read_records(path)


def test_a_fresh_run_starts_a_new_log(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("garbage from another run\n")
    MetricsLog(tmp_path).close()
    assert read_records(tmp_path / "metrics.jsonl") == []


def test_busy_time_leaves_out_collective_waits():
    t = Timeline()
    t.record("generate", __import__("time").time() - 2.0)  # a 2 s phase
    t.waited(0.5)  # of which 0.5 s blocked in an all-reduce
    assert abs(t.busy_since_last_report() - 1.5) < 0.05
    t.record("train", __import__("time").time() - 1.0)
    assert abs(t.busy_since_last_report() - 1.0) < 0.05  # only what happened since the last report
    assert [phase for phase, _, _ in t.events] == ["generate", "train"]
