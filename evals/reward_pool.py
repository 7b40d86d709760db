"""Scoring responses in worker processes with a per-sample timeout.

    pool = RewardPool(RewardSpec(name="math_dapo", timeout_s=10), processes=2)
    results = pool.score([(response, {"prompt": ..., "answer": "42"}), ...])   # [RewardResult, ...]

Each worker is a fresh interpreter (`python -m evals.reward_pool SPEC IN_FD OUT_FD`, never a fork of the trainer)
that reads JSON requests (a list of samples per line) from a pipe of its own and writes one JSON result line per
sample, in order, to another; rewards run in its main thread, so math-verify's own timeout (signal.alarm, main
thread only) works there. The samples are split into one contiguous batch per worker, sent as one request (one
round trip per batch, not per sample: 5% of the default step). A worker first imports what its reward needs
(math-verify, the user's module) and says "ready"; its start is not a sample's time (on a loaded machine it took
longer than a short timeout_s, and the first sample of every fresh worker timed out). It has STARTUP_S for that,
or the pool raises. Each sample then gets `timeout_s` from the moment its worker starts it (the worker's "ready"
or the previous result's arrival): a worker that has not answered by then is killed and replaced, its sample is
a timeout, and the rest of its batch goes to the new worker, so one bad sample costs at most timeout_s plus a
restart. An exception of any kind
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
from collections import deque
from dataclasses import asdict, dataclass
from typing import Callable

STARTUP_S = 300.0  # for a reward process to import its reward and say it is ready (~1 s on an idle 2-core machine)
READY = "ready"  # a reward process's first line, before any result


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
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "evals.reward_pool",
                    json.dumps(asdict(spec)),
                    str(request_read),
                    str(result_write),
                ],
                stdin=subprocess.DEVNULL,
                stdout=sys.__stderr__.fileno(),
                pass_fds=(request_read, result_write),
                env=env,
            )
        finally:
            os.close(request_read)
            os.close(result_write)
        self.requests = os.fdopen(request_write, "w", buffering=1)
        self.results = result_read  # read with os.read: a buffered reader would hide lines from the selector
        self.received = b""  # bytes read past the last complete line
        self.started = time.monotonic()
        self.ready = False  # its READY line has arrived

    def result_lines(self, lines: list[str]) -> list[str]:
        """`lines` without the READY line, which marks the worker ready; RuntimeError if results come first."""
        if not self.ready and lines:
            if json.loads(lines[0]) != READY:
                raise RuntimeError(f"reward process sent {lines[0][:200]!r} before it was ready")
            self.ready, lines = True, lines[1:]
        return lines

    def failed_start(self) -> RuntimeError:
        """The error of a worker that exited, or passed STARTUP_S, before it was ready (either is no sample's fault:
        its reward cannot be imported, or the machine cannot start it)."""
        if (code := self.proc.poll()) is not None:
            return RuntimeError(f"a reward process exited with code {code} before it was ready")
        return RuntimeError(f"a reward process was not ready within {STARTUP_S:g} s of its start")

    def wait_ready(self) -> None:
        """Block until the READY line arrives (only it can come before a request); failed_start() if it does not."""
        import select

        while not self.ready:
            left = self.started + STARTUP_S - time.monotonic()
            if left <= 0 or not select.select([self.results], [], [], left)[0]:
                raise self.failed_start()
            lines = self.read_lines()
            if lines is None:
                self.proc.wait()
                raise self.failed_start()
            if self.result_lines(lines):
                raise RuntimeError("a reward process sent results before any request")

    def send(self, samples: list[tuple[str, dict]]) -> None:
        self.requests.write(json.dumps([[response, row] for response, row in samples]) + "\n")
        self.requests.flush()

    def read_lines(self) -> list[str] | None:
        """The complete result lines that have arrived (read once the selector says the pipe is readable); None
        when the process closed its end (it died)."""
        chunk = os.read(self.results, 1 << 16)
        if not chunk:
            return None
        *lines, self.received = (self.received + chunk).split(b"\n")
        return [line.decode() for line in lines]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        try:
            self.requests.close()
        except OSError:  # a request the dead process never read
            pass
        os.close(self.results)


class RewardPool:
    """`processes` reward processes (started on first use) scoring with `spec`; `close()` or the with-block
    stops them."""

    def __init__(self, spec: RewardSpec, processes: int = 1):
        if spec.function is not None:
            load_function(spec.function)  # fail here, before any sample, naming the path
        self.spec, self.processes = spec, max(1, processes)
        self.workers: list[_Worker] = []

    def start(self, processes: int | None = None) -> None:
        """Start the pool's processes (`processes` of them, all by default) and wait until each is ready: a caller
        that wants their start out of its first `score` (which otherwise starts them itself)."""
        while len(self.workers) < (self.processes if processes is None else processes):
            self.workers.append(_Worker(self.spec))
        for worker in self.workers:
            worker.wait_ready()

    def score(self, samples: list[tuple[str, dict]]) -> list[RewardResult]:
        """A result per (response, row), in order."""
        results: list[RewardResult | None] = [None] * len(samples)
        pending = {
            p: deque(batch) for p, batch in enumerate(_split(len(samples), self.processes))
        }  # per worker: its samples not yet scored
        while len(self.workers) < len(pending):
            self.workers.append(_Worker(self.spec))
        selector = selectors.DefaultSelector()
        deadlines: dict[int, float] = {}

        def deadline(worker: _Worker) -> float:  # a sample's time starts once its worker is ready
            return time.monotonic() + self.spec.timeout_s if worker.ready else worker.started + STARTUP_S

        def start(p: int) -> None:  # send worker p what is left of its batch
            self.workers[p].send([samples[i] for i in pending[p]])
            selector.register(self.workers[p].results, selectors.EVENT_READ, p)
            deadlines[p] = deadline(self.workers[p])

        def replace(p: int, error: str) -> None:  # worker p failed its current sample: a fresh one takes the rest
            results[pending[p].popleft()] = RewardResult(None, error)
            selector.unregister(self.workers[p].results)
            self.workers[p].kill()
            self.workers[p] = _Worker(self.spec)
            if pending[p]:
                start(p)
            else:
                del pending[p]

        for p in pending:
            start(p)
        while pending:
            wait = min(deadlines[p] for p in pending) - time.monotonic()
            for key, _ in selector.select(timeout=max(wait, 0.0)):
                p = key.data
                worker = self.workers[p]
                lines = worker.read_lines()
                if lines is None and not worker.ready:
                    worker.proc.wait()
                    raise worker.failed_start()
                if lines is None:  # the process died (e.g. killed by the OS): restart it
                    replace(p, f"reward process exited with code {worker.proc.wait()}")
                    continue
                for line in worker.result_lines(lines):
                    value, error = json.loads(line)
                    results[pending[p].popleft()] = RewardResult(value, error)
                deadlines[p] = deadline(worker)
                if not pending[p]:
                    selector.unregister(self.workers[p].results)
                    del pending[p]
            now = time.monotonic()
            for p in [p for p in pending if deadlines[p] <= now]:  # still running its sample: a timeout
                if not self.workers[p].ready:
                    raise self.workers[p].failed_start()
                replace(p, f"timeout after {self.spec.timeout_s:g}s")
        selector.close()
        return results

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def warm_up(spec: RewardSpec) -> None:
    """Import what scoring with `spec` will import, so that its first sample's time is its own."""
    if spec.function is not None:
        load_function(spec.function)
    else:
        import math_verify  # noqa: F401 - the math rewards import it lazily (~1 s)

        import evals.rewards  # noqa: F401


def _split(count: int, parts: int) -> list[range]:
    """range(count) in min(parts, count) contiguous batches whose sizes differ by at most one."""
    n = min(parts, count)
    if n == 0:
        return []
    size, extra = divmod(count, n)
    starts = [i * size + min(i, extra) for i in range(n + 1)]
    return [range(starts[i], starts[i + 1]) for i in range(n)]


def serve(spec: RewardSpec, request_fd: int, result_fd: int) -> None:
    """A reward process: once its reward is imported, the JSON line READY to result_fd; then JSON lines
    [[response, row], ...] in from request_fd, one JSON line [score | null, error | null] per sample out to
    result_fd, in order. Neither descriptor is passed on to the processes that user code starts."""
    for fd in (request_fd, result_fd):
        os.set_inheritable(fd, False)
    with os.fdopen(request_fd, "r") as requests, os.fdopen(result_fd, "w") as results:
        warm_up(spec)
        results.write(json.dumps(READY) + "\n")
        results.flush()
        for line in requests:
            for response, row in json.loads(line):
                results.write(json.dumps(list(_guarded(spec, response, row))) + "\n")
                results.flush()


if __name__ == "__main__":
    serve(RewardSpec(**json.loads(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]))
