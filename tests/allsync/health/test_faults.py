"""Fault drills (allsync/health/faults.py): the config names a bad entry by key, and each fault does what it says on its
rank, during its steps only."""

import time

import pytest
import torch

from allsync.config import ConfigError, parse_config
from allsync.health.faults import Fault, FaultInjector, parse_faults


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"kind": "slow", "rank": 0}, r"health.faults\[0\].step: missing"),
        ({"kind": "slo", "rank": 0, "step": 1}, r"health.faults\[0\].kind = 'slo': unknown \(valid: slow, hog, hang"),
        ({"kind": "slow", "rank": 2, "step": 1}, r"health.faults\[0\].rank = 2: the run has workers 0..1"),
        ({"kind": "slow", "rank": 0, "step": 0}, r"health.faults\[0\].step = 0: must be >= 1"),
        ({"kind": "slow", "rank": 0, "step": 1, "factor": -1}, r"health.faults\[0\].factor = -1: must be > 0"),
        ({"kind": "slow", "rank": 0, "step": 1, "sleep": 1}, r"health.faults\[0\].sleep: unknown key"),
    ],
)
def test_a_bad_fault_entry_is_refused_naming_its_key(entry, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"parallel": {"workers_per_node": 2}, "health": {"faults": [entry]}})


def test_health_settings_and_restart_settings_are_checked():
    for data, message in [
        ({"health": {"detector": "minder"}}, "health.detector = 'minder'"),
        ({"health": {"continuity": 0}}, "health.continuity = 0: must be >= 1"),
        ({"run": {"max_restarts": -1}}, "run.max_restarts = -1"),
        ({"run": {"step_timeout": -5}}, "run.step_timeout = -5"),
        ({"health": {"detector": "threshold", "window": 3}}, "health.window = 3 with health.detector threshold"),
        ({"health": {"detector": "off", "min_z": 2.0}}, "health.min_z = 2.0 with health.detector off"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_config(data)


def test_faults_hit_their_rank_during_their_steps_only():
    faults = parse_faults(
        [
            {"kind": "nan", "rank": 1, "step": 3, "steps": 2},
            {"kind": "leak", "rank": 1, "step": 6, "steps": 2, "mb": 8},
        ],
        2,
    )
    other, mine = FaultInjector(faults, 0), FaultInjector(faults, 1)
    seen = []
    for step in range(1, 9):
        for injector in (other, mine):
            injector.begin_step(step)
        grads = [torch.ones(4), torch.ones(4)]
        other.before_gradient_reduce(grads[0])
        mine.before_gradient_reduce(grads[1])
        seen.append((bool(grads[0].isnan().any()), bool(grads[1].isnan().any()), len(mine.leaked), len(other.leaked)))
    assert seen == [
        (False, False, 0, 0),
        (False, False, 0, 0),
        (False, True, 0, 0),
        (False, True, 0, 0),
        (False, False, 0, 0),
        (False, False, 1, 0),
        (False, False, 2, 0),
        (False, False, 0, 0),
    ]
    assert mine.leaked == []  # freed when the leak ends


def test_slow_hang_and_delay_take_the_time_they_say():
    injector = FaultInjector(
        [Fault("slow", 0, 1, factor=3.0), Fault("hang", 0, 2, seconds=0.3), Fault("delay", 0, 3, seconds=0.2)], 0
    )
    timings = []
    for step in (1, 2, 3):
        injector.begin_step(step)
        t = time.perf_counter()
        injector.during_generate()
        injector.after_generate(0.1)
        injector.before_gradient_reduce(torch.zeros(1))
        timings.append(time.perf_counter() - t)
    assert [round(x, 1) for x in timings] == [0.2, 0.3, 0.2]


def test_a_hog_spins_while_it_lasts_and_drills_are_off_after_a_restart():
    injector = FaultInjector([Fault("hog", 0, 1, steps=1)], 0)
    injector.begin_step(1)
    assert injector.hog is not None and injector.hog.thread.is_alive()
    thread = injector.hog.thread
    injector.begin_step(2)
    assert injector.hog is None and not thread.is_alive()
    restarted = FaultInjector([Fault("kill", 0, 1)], 0, enabled=False)
    restarted.begin_step(1)
    restarted.during_generate()  # a kill drill would end this process here
    assert restarted.faults == []
