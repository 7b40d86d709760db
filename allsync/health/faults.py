"""Fault drills: faults injected into one worker of a live run, to check that the health detector finds it
and that the run survives it (`health.faults` in a config; benchmarks/faults.py).

Each fault hits one rank for `steps` consecutive RL steps from `step` on:
- slow:  the generate phase takes `factor` times as long (a sleep after it: a throttled device);
- hog:   a thread spinning in the worker's process (a CPU hog: it competes for the interpreter and a core);
- hang:  one stall of `seconds` in the generate phase of the first step (a hung kernel or filesystem);
- delay: a sleep of `seconds` before every gradient all-reduce (a delayed gradient group);
- nan:   this worker's gradients become NaN before the all-reduce (every worker then skips the step);
- leak:  `mb` MiB more resident memory each step while it lasts (freed when it ends, so drills stay bounded);
- kill:  the process kills itself (SIGKILL) in the middle of the step's generate phase (a lost worker).
Drills fire only in a run's first attempt: a run restarted after a lost worker does not replay them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, fields

import torch

FAULT_KINDS = ("slow", "hog", "hang", "delay", "nan", "leak", "kill")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int  # the first RL step it hits (1-based, as logged)
    steps: int = 1  # how many consecutive steps
    factor: float = 2.0  # slow: generate takes factor x as long
    seconds: float = 5.0  # hang: the stall; delay: the sleep before each gradient all-reduce
    mb: float = 64.0  # leak: MiB added per step

    def active(self, step: int) -> bool:
        return self.step <= step < self.step + self.steps


def parse_faults(entries: list[dict], workers: int, where: str = "health.faults") -> list[Fault]:
    """Config entries -> Faults; a ValueError naming `where[i].key` for an unknown key or kind, a rank outside
    the workers, or a step, count or size out of range."""
    names = {f.name for f in fields(Fault)}
    faults = []
    for i, entry in enumerate(entries):
        key = f"{where}[{i}]"
        unknown = sorted(set(entry) - names)
        if unknown:
            raise ValueError(f"{key}.{unknown[0]}: unknown key (known: {', '.join(sorted(names))})")
        missing = [n for n in ("kind", "rank", "step") if n not in entry]
        if missing:
            raise ValueError(f"{key}.{missing[0]}: missing")
        fault = Fault(**entry)
        if fault.kind not in FAULT_KINDS:
            raise ValueError(f"{key}.kind = {fault.kind!r}: unknown (valid: {', '.join(FAULT_KINDS)})")
        if not 0 <= fault.rank < workers:
            raise ValueError(f"{key}.rank = {fault.rank}: the run has workers 0..{workers - 1}")
        for name, low in (("step", 1), ("steps", 1)):
            if getattr(fault, name) < low:
                raise ValueError(f"{key}.{name} = {getattr(fault, name)}: must be >= {low}")
        for name in ("factor", "seconds", "mb"):
            if not getattr(fault, name) > 0:
                raise ValueError(f"{key}.{name} = {getattr(fault, name)}: must be > 0")
        faults.append(fault)
    return faults


class CPUHog:
    """A daemon thread that spins until stopped."""

    def __init__(self):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()

    def _spin(self) -> None:
        x = 0
        while not self.stop.is_set():
            x += 1

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


class FaultInjector:
    """This rank's drills. The worker calls `begin_step` when a step starts, `after_generate(seconds)` after
    its generate phase, and the learner `before_gradient_reduce(flat_grad)` before every gradient all-reduce."""

    def __init__(self, faults: list[Fault], rank: int, enabled: bool = True):
        self.faults = [f for f in faults if f.rank == rank] if enabled else []
        self.step = 0
        self.hog: CPUHog | None = None
        self.leaked: list[torch.Tensor] = []

    def _active(self, kind: str) -> Fault | None:
        return next((f for f in self.faults if f.kind == kind and f.active(self.step)), None)

    def begin_step(self, step: int) -> None:
        self.step = step
        hog = self._active("hog")
        if hog is not None and self.hog is None:
            self.hog = CPUHog()
        elif hog is None and self.hog is not None:
            self.hog.close()
            self.hog = None
        if (leak := self._active("leak")) is not None:  # touched, so the pages are resident
            self.leaked.append(torch.ones(int(leak.mb * 2**20) // 4, dtype=torch.float32))
        else:
            self.leaked.clear()

    def during_generate(self) -> None:
        """Inside the generate phase: a kill or the first step's hang."""
        if self._active("kill") is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        hang = self._active("hang")
        if hang is not None and hang.step == self.step:
            time.sleep(hang.seconds)

    def after_generate(self, seconds: float) -> None:
        if (slow := self._active("slow")) is not None:
            time.sleep((slow.factor - 1) * seconds)

    def before_gradient_reduce(self, flat_grad: torch.Tensor) -> None:
        if (delay := self._active("delay")) is not None:
            time.sleep(delay.seconds)
        if self._active("nan") is not None:
            flat_grad.fill_(float("nan"))

    def close(self) -> None:
        if self.hog is not None:
            self.hog.close()
            self.hog = None
        self.leaked.clear()
