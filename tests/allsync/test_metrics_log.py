"""metrics.jsonl survives a run killed mid-line; busy time leaves out collective waits."""

import json

import pytest

from allsync.metrics import MetricsLog, read_records
from allsync.health.monitor import Timeline


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


def test_the_health_report_splits_phase_time_waits_and_reward_scoring():
    import time

    import torch

    from allsync.health.monitor import WorkerMonitor

    m = WorkerMonitor(torch.device("cpu"))
    m.timeline.waited(0.5)  # blocked in a collective inside the generate phase, recorded at its end
    m.timeline.record("generate", time.time() - 2.0)
    m.reward_seconds = 0.3  # of the generate phase, scoring rewards
    m.timeline.record("train", time.time() - 1.0)
    r = m.report({"train_positions": 3000}, engine_positions=1200)
    # generate busy: 2.0 - 0.5 waiting - 0.3 scoring = 1.2 s -> 1000 positions/s; train: 1 s -> 3000 positions/s
    assert (
        abs(r["generate_seconds"] - 1.2) < 0.02 and abs(r["wait_seconds"] - 0.5) < 1e-9 and r["reward_seconds"] == 0.3
    )
    assert abs(r["generate_tokens_per_second"] - 1000) < 20 and abs(r["train_tokens_per_second"] - 3000) < 60
    assert r["rss_bytes"] > 2**20 and r["rss_growth_bytes"] == 0 and r["probe_seconds"] < 0.05
    kept = torch.ones(64 * 2**20 // 4)  # 64 MiB resident before the next report
    again = m.report({"train_positions": 0}, engine_positions=0)
    assert again["generate_seconds"] == again["train_seconds"] == again["wait_seconds"] == 0.0  # reset after a report
    assert again["rss_growth_bytes"] > 60 * 2**20 and kept.sum() > 0


def test_an_nvml_reading_the_driver_refuses_is_left_out():
    """NVML answers NVMLError for a reading it cannot give (here every one: no NVML library on this machine);
    the sample leaves those keys out instead of failing the step, and the health detector skips them."""
    import pynvml

    from allsync.health.monitor import gpu_sample

    with pytest.raises(pynvml.NVMLError):
        pynvml.nvmlDeviceGetPowerUsage(None)  # what the sample meets
    assert gpu_sample(None) == {}
