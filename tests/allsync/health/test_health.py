"""The health detector (allsync/health/detector.py) on synthetic worker reports: it names the worker that stands out from
the others, ignores a slowdown every worker shares (where the threshold baseline alarms), alarms at once on a
non-finite gradient, waits `continuity` steps for an ordinary deviation, prefers the higher-priority metric; its
monitor writes workers.jsonl / health.jsonl and replays them on resume; `allsync health` reports and draws them."""

import json
import math

import numpy as np
import pytest

from allsync.cli import main as cli
from allsync.health.detector import (
    HealthMonitor,
    SimilarityDetector,
    ThresholdDetector,
    alarm_record,
    read_health_events,
    replay,
)


def reports(steps: int, workers: int = 4, seed: int = 0, common: float = 0.2, own: float = 0.1) -> list[list[dict]]:
    """Per step, per worker: throughputs with a shared per-step factor (every worker slower on long steps) and
    each worker's own noise (lognormal sigmas `common`, `own`), memory growth noise, CPU %, gradient norms."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        shared = math.exp(rng.normal(0, common))
        out.append(
            [
                {
                    "generate_tokens_per_second": 1500 * shared * math.exp(rng.normal(0, own)),
                    "train_tokens_per_second": 1600 * shared * math.exp(rng.normal(0, own)),
                    "sync_seconds": 0.001 * math.exp(rng.normal(0, own)),
                    "rss_growth_bytes": float(rng.normal(0, 4 * 2**20)),
                    "cpu_percent": 45 * math.exp(rng.normal(0, own)),
                    "local_grad_norm": 0.11 * math.exp(rng.normal(0, own)),
                }
                for _ in range(workers)
            ]
        )
    return out


def run(detector, trace) -> list:
    return [a for step, r in enumerate(trace, 1) for a in detector.observe(step, r)]


def test_a_clean_fleet_raises_no_alarm():
    assert run(SimilarityDetector(), reports(300)) == []


def test_the_slow_worker_is_named_after_continuity_steps():
    trace = reports(60)
    for step in (30, 31, 32):  # worker 2 generates at half speed for 3 steps (steps are 1-based)
        trace[step - 1][2]["generate_tokens_per_second"] *= 0.5
    alarms = run(SimilarityDetector(continuity=2), trace)
    assert [(a.step, a.rank, a.metric, a.direction) for a in alarms] == [(31, 2, "generate_tokens_per_second", "low")]
    assert [(a.step, a.rank) for a in run(SimilarityDetector(continuity=3), trace)] == [(32, 2)]


def test_a_faster_worker_is_not_faulty_for_a_low_is_bad_metric():
    trace = reports(60)
    for step in (30, 31, 32):
        trace[step - 1][1]["generate_tokens_per_second"] *= 2.0
    assert run(SimilarityDetector(), trace) == []


def test_a_slowdown_every_worker_shares_is_no_fault_but_trips_the_threshold_baseline():
    trace = reports(60, common=0.02)
    for step in range(30, 36):  # every worker at a third of the speed: e.g. longer responses for everyone
        for w in trace[step - 1]:
            w["generate_tokens_per_second"] /= 3
    assert run(SimilarityDetector(), trace) == []
    baseline = run(ThresholdDetector(), trace)
    assert {a.rank for a in baseline} == {0, 1, 2, 3} and {a.step for a in baseline} >= {30}


def test_a_non_finite_gradient_alarms_at_once_on_its_worker():
    trace = reports(20)
    trace[9][3]["local_grad_norm"] = float("nan")
    alarms = run(SimilarityDetector(continuity=3), trace)
    assert [(a.step, a.rank, a.metric, a.direction) for a in alarms] == [(10, 3, "local_grad_norm", "non-finite")]
    assert json.loads(json.dumps(alarm_record(alarms[0])))["distance"] is None  # inf is not JSON


def test_a_stall_of_many_times_the_noise_alarms_without_waiting():
    trace = reports(40)
    trace[29][1]["generate_tokens_per_second"] /= 40  # one step 40x slower: a 10 s stall in a 0.25 s phase
    alarms = run(SimilarityDetector(continuity=2), trace)
    assert [(a.step, a.rank) for a in alarms] == [(30, 1)]


def test_the_higher_priority_metric_names_the_worker():
    trace = reports(60)
    for step in (30, 31, 32):
        trace[step - 1][1]["generate_tokens_per_second"] *= 0.4  # priority 2
        trace[step - 1][3]["cpu_percent"] *= 3  # priority 6 (a lower one)
    alarms = run(SimilarityDetector(), trace)
    assert [(a.rank, a.metric) for a in alarms] == [(1, "generate_tokens_per_second")]


def test_two_workers_cannot_be_told_apart_and_a_silent_worker_is_skipped():
    trace = reports(40, workers=2)
    for step in (30, 31, 32):
        trace[step - 1][0]["generate_tokens_per_second"] *= 0.3
    assert run(SimilarityDetector(), trace) == []
    trace = reports(40)
    trace[20][1] = None  # no report from worker 1 at step 21
    assert run(SimilarityDetector(), trace) == []


def test_replay_of_the_monitor_files_gives_the_online_alarms_and_resume_keeps_the_state(tmp_path):
    trace = reports(50)
    for step in (20, 21, 22):
        trace[step - 1][0]["train_tokens_per_second"] *= 0.4
    trace[39][2]["local_grad_norm"] = float("inf")
    monitor = HealthMonitor(tmp_path, SimilarityDetector(), None)
    online = [a for step, r in enumerate(trace, 1) for a in monitor.observe(step, r)]
    assert [(a.step, a.rank) for a in online] == [(21, 0), (40, 2)]
    assert [(e["step"], e["rank"]) for e in read_health_events(tmp_path)] == [(21, 0), (40, 2)]
    records = [json.loads(line) for line in (tmp_path / "workers.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 51)) and records[0]["workers"][1] == trace[0][1]
    assert replay(records, SimilarityDetector()) == online
    # resume at step 21: later records go, the detector replays 1..21 and sees worker 0's streak go on... and end
    resumed = HealthMonitor(tmp_path, SimilarityDetector(), 21)
    assert len((tmp_path / "workers.jsonl").read_text().splitlines()) == 21
    again = [a for step, r in enumerate(trace[21:], 22) for a in resumed.observe(step, r)]
    assert [(a.step, a.rank) for a in again] == [(40, 2)]  # worker 0 was alarmed before the resume: not twice


def test_allsync_health_prints_the_report_and_draws_the_timeline(tmp_path, capsys):
    trace = reports(30)
    for step in (10, 11, 12):
        trace[step - 1][3]["generate_tokens_per_second"] *= 0.3
    monitor = HealthMonitor(tmp_path, SimilarityDetector(), None)
    for step, r in enumerate(trace, 1):
        monitor.observe(step, r)
    with (tmp_path / "health.jsonl").open("a") as f:
        f.write(
            json.dumps(
                {"event": "restart", "time": 0.0, "restart": 1, "cause": "worker 1 failed in step: ActorDiedError"}
            )
            + "\n"
        )
    assert cli(["health", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "steps 1-30, 4 workers" in out
    assert "alarms: 1\n  step 11: worker 3 is faulty (low generate_tokens_per_second" in out
    assert "restarts: 1\n  restart 1: worker 1 failed in step: ActorDiedError" in out
    assert (tmp_path / "health.png").stat().st_size > 10_000
    assert cli(["health", str(tmp_path), "--replay", "threshold", "--png", str(tmp_path / "t.png")]) == 0
    assert "(threshold, replayed)" in capsys.readouterr().out


def test_a_run_directory_without_records_is_an_error_naming_the_file(tmp_path, capsys):
    assert cli(["health", str(tmp_path)]) == 2
    assert f"{tmp_path / 'workers.jsonl'}: no per-worker records" in capsys.readouterr().err


@pytest.mark.parametrize("workers", [64, 1024])
def test_one_slow_worker_among_many_is_found(workers):
    trace = reports(30, workers=workers, seed=workers)
    for step in (20, 21, 22):  # a third of the speed: even the window's first half is far out
        trace[step - 1][workers - 1]["train_tokens_per_second"] *= 0.3
    alarms = run(SimilarityDetector(), trace)
    assert [(a.step, a.rank) for a in alarms] == [(21, workers - 1)]


def test_a_zero_gradient_is_no_fault_but_an_infinite_one_is():
    trace = reports(20)
    trace[9][0]["local_grad_norm"] = 0.0  # no token of its own trained this step: log(0) is not "non-finite"
    trace[14][2]["local_grad_norm"] = float("inf")
    for detector in (SimilarityDetector(), ThresholdDetector()):
        assert [(a.step, a.rank, a.direction) for a in run(detector, trace)] == [(15, 2, "non-finite")]


def test_memory_that_mostly_does_not_grow_keeps_a_noise_floor():
    """Most steps grow no worker's memory (growth exactly 0), so the noise scale of rss_growth_bytes would collapse:
    a page of heap after a checkpoint then read as a leak (the drill with checkpoints on: precision 0.659, every
    false alarm this metric). The 16 MiB floor ignores a few pages and still names a 128 MiB-per-step leak."""
    trace = reports(60)
    for step in trace:
        for worker in step:
            worker["rss_growth_bytes"] = 0.0
    for step in (20, 21):  # heap pages after a checkpoint on worker 1
        trace[step - 1][1]["rss_growth_bytes"] = 4096.0 * step
    assert run(SimilarityDetector(), trace) == []
    for step in (40, 41, 42):  # worker 3 leaks 128 MiB a step
        trace[step - 1][3]["rss_growth_bytes"] = 128.0 * 2**20
    assert [(a.rank, a.metric) for a in run(SimilarityDetector(), trace)] == [(3, "rss_growth_bytes")]
