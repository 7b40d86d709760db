"""Scoring responses in worker processes with a per-sample timeout.

    pool = RewardPool(RewardSpec(name="math_dapo", timeout_s=10), processes=2)
    results = pool.score([(response, {"prompt": ..., "answer": "42"}), ...])   # [RewardResult, ...]

Each worker is a fresh interpreter (`python -m evals.reward_pool SPEC IN_FD OUT_FD`, never a fork of the trainer)
that reads one JSON line per sample from a pipe of its own and writes one JSON result line to another; rewards run
in its main thread, so
math-verify's own timeout (signal.alarm, main thread only) works there. Samples go out in waves, one per
worker, and each wave gets `timeout_s`: a worker that has not answered by then is killed and replaced, and
its sample is a timeout, so one bad sample costs at most timeout_s plus a restart. An exception of any kind
(math-verify's TimeoutException subclasses BaseException) comes back as an error naming its type, and so does a
score that is NaN or infinite. User code cannot reach the protocol: the process's stdin is /dev/null, its stdout
(fd 1: print, C code, child processes such as `echo`) is the parent's stderr, and the protocol pipes are not
inherited by the processes user code starts.

The reward is a registry name (`evals.rewards.score(name, response, ground_truth)` with the row's "answer"),
or a user function `"package.module:function"` called as function(response, row) -> float | dict, where a
dict carries the score under "score". Rows and results cross as JSON: nothing is unpickled.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import selectors
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable


@dataclass(frozen=True)
class RewardSpec:
    name: str = "arithmetic"  # a name in evals.rewards.REWARDS (used when function is None)
    function: str | None = None  # "package.module:function": function(response, row) -> float | dict with "score"
    timeout_s: float = 10.0


@dataclass(frozen=True)
class RewardResult:
    score: float | None  # None when the reward failed
    error: str | None = None  # "timeout after 2s" or "ZeroDivisionError: ..."


def load_function(path: str, kind: str = "function") -> Callable:
    """`package.module:function` (or a class, kind "class") -> it; ValueError naming what is wrong."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{path!r} is not of the form package.module:{kind}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{module_name!r} has no {kind} {attr!r}")
    return fn


def score_sample(spec: RewardSpec, response: str, row: dict) -> float:
    """One sample's reward, in whatever process calls it."""
    if spec.function is None:
        from evals.rewards import score

        return float(score(spec.name, response, str(row["answer"]), row.get("metadata")))
    out = load_function(spec.function)(response, row)
    if isinstance(out, dict):
        if "score" not in out:
            raise TypeError(f"{spec.function} returned a dict without 'score' (keys {sorted(out)})")
        out = out["score"]
    score = float(out)
    if not math.isfinite(score):
        raise ValueError(f"the reward is {score}, not a finite number")
    return score


def _guarded(spec: RewardSpec, response: str, row: dict) -> tuple[float | None, str | None]:
    try:
        return score_sample(spec, response, row), None
    except BaseException as exc:  # noqa: BLE001 - math-verify's TimeoutException is a BaseException
        return None, f"{type(exc).__name__}: {exc}"


class _Worker:
    """One reward process and its two protocol pipes (requests in, results out)."""

    def __init__(self, spec: RewardSpec):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # the parent's imports resolve
        request_read, request_write = os.pipe()
        result_read, result_write = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "evals.reward_pool", json.dumps(asdict(spec)), str(request_read),
                                          str(result_write)], stdin=subprocess.DEVNULL, stdout=sys.__stderr__.fileno(),
                                         pass_fds=(request_read, result_write), env=env)  # fmt: skip
        finally:
            os.close(request_read)
            os.close(result_write)
        self.requests = os.fdopen(request_write, "w", buffering=1)
        self.results = os.fdopen(result_read, "r")

    def send(self, response: str, row: dict) -> None:
        self.requests.write(json.dumps([response, row]) + "\n")
        self.requests.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.requests, self.results):
            try:
                pipe.close()
            except OSError:  # a request the dead process never read
                pass


class RewardPool:
    """`processes` reward processes (started on first use) scoring with `spec`; `close()` or the with-block
    stops them."""

    def __init__(self, spec: RewardSpec, processes: int = 1):
        if spec.function is not None:
            load_function(spec.function)  # fail here, before any sample, naming the path
        self.spec, self.processes = spec, max(1, processes)
        self.workers: list[_Worker] = []

    def score(self, samples: list[tuple[str, dict]]) -> list[RewardResult]:
        """A result per (response, row), in order."""
        results: list[RewardResult] = []
        for start in range(0, len(samples), self.processes):
            results += self._wave(samples[start : start + self.processes])
        return results

    def _wave(self, wave: list[tuple[str, dict]]) -> list[RewardResult]:
        while len(self.workers) < len(wave):
            self.workers.append(_Worker(self.spec))
        selector = selectors.DefaultSelector()
        for i, (response, row) in enumerate(wave):
            self.workers[i].send(response, row)
            selector.register(self.workers[i].results, selectors.EVENT_READ, i)
        results: dict[int, RewardResult] = {}
        deadline = time.monotonic() + self.spec.timeout_s
        while len(results) < len(wave) and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(timeout=left):
                i = key.data
                line = self.workers[i].results.readline()
                selector.unregister(key.fileobj)
                if not line:  # the process died (e.g. killed by the OS): restart it
                    results[i] = RewardResult(None, f"reward process exited with code {self.workers[i].proc.wait()}")
                    self.workers[i].kill()
                    self.workers[i] = _Worker(self.spec)
                    continue
                value, error = json.loads(line)
                results[i] = RewardResult(value, error)
        selector.close()
        for i in range(len(wave)):
            if i not in results:  # still running its sample: kill it, a fresh one takes its place
                self.workers[i].kill()
                self.workers[i] = _Worker(self.spec)
                results[i] = RewardResult(None, f"timeout after {self.spec.timeout_s:g}s")
        return [results[i] for i in range(len(wave))]

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def serve(spec: RewardSpec, request_fd: int, result_fd: int) -> None:
    """A reward process: one JSON line [response, row] in from request_fd, one JSON line [score | null, error | null]
    out to result_fd. Neither descriptor is passed on to the processes that user code starts."""
    for fd in (request_fd, result_fd):
        os.set_inheritable(fd, False)
    with os.fdopen(request_fd, "r") as requests, os.fdopen(result_fd, "w") as results:
        for line in requests:
            response, row = json.loads(line)
            results.write(json.dumps(list(_guarded(spec, response, row))) + "\n")
            results.flush()


if __name__ == "__main__":
    serve(RewardSpec(**json.loads(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]))
