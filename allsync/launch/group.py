"""What every launch mode shares: the `WorkerGroup` protocol the training loop drives, the failures it raises, and
the registry that picks a mode for a run.

A launch mode is a class in a module of allsync/launch/ registered with `@register_launch_mode`; besides the
`WorkerGroup` methods it provides

    order: int                                   modes are asked in this order
    chosen(launched, no_ray, config) -> bool     (static) whether this run is one of its
    refusal(config, no_ray, world_size) -> str | None
        (static) what this mode cannot run, said before any work (world_size: the launcher's WORLD_SIZE, or None)
    run(config, problems, max_model_len, train, resume, out_dir) -> int
        (class method) start the workers and run `train(group, resume, own)` (recipes/dapo.py's loop) with them,
        restarting after a lost worker as the mode can; returns the process's exit code
"""

from __future__ import annotations

import importlib
import pkgutil
import socket
from typing import Protocol


class WorkerGroup(Protocol):
    """The workers as the training loop sees them, whatever the mode.

    call(method, *args) -> list       the method on every worker, every worker's result in rank order
    call_for_rank0(method, *args)     the method on every worker (they may take part in a collective); rank 0's
                                      result (None in the processes that are not the controller)
    agree(value)                      the controller's value, in every process
    step(step) -> list[dict]          one all-sync step; per-worker metric sums
    is_controller: bool               this process writes logs, checkpoints and exports
    shutdown()                        stop the workers (once; later calls do nothing)
    """

    is_controller: bool

    def call(self, method: str, *args) -> list: ...

    def call_for_rank0(self, method: str, *args): ...

    def agree(self, value): ...

    def step(self, step: int) -> list[dict]: ...

    def shutdown(self) -> None: ...


class WorkerFailure(RuntimeError):
    """A worker raised (or its process died); every other worker has been stopped. Names the rank."""

    def __init__(self, rank: int, method: str, error: BaseException):
        self.rank, self.method, self.error = rank, method, error
        super().__init__(f"worker {rank} failed in {method}: {type(error).__name__}: {error}")


class WorkerTimeout(WorkerFailure):
    """No answer from some workers within run.step_timeout; every worker has been stopped. Under all-sync the
    healthy workers wait in a collective for the lost one, so all of them are usually silent."""

    def __init__(self, ranks: list[int], method: str, seconds: float):
        self.ranks = ranks
        error = TimeoutError(
            f"no answer from worker(s) {', '.join(map(str, ranks))} within run.step_timeout = {seconds:g} s"
        )
        super().__init__(ranks[0], method, error)


# the exit code of an SPMD process that lost a peer or passed run.step_timeout: an elastic launcher
# (torchrun --max-restarts N) restarts every process, and the run resumes from its newest good checkpoint
EXIT_RESTART = 75
# torch intra-op threads of every worker, in both modes: CPU kernels round differently with other thread counts
# (a 2-thread matmul is 1e-5 from a 1-thread one), so a torchrun run under another OMP_NUM_THREADS would
# otherwise drift from the Ray run of the same config and seed
WORKER_THREADS = 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


LAUNCH_MODES: list[type] = []


def register_launch_mode(cls: type) -> type:
    """Class decorator: `cls` is one of the modes `launch_mode` picks from (in `cls.order`)."""
    LAUNCH_MODES.append(cls)
    LAUNCH_MODES.sort(key=lambda mode: mode.order)
    return cls


def launch_mode(launched: bool, no_ray: bool, config) -> type:
    """The first registered mode (every module of allsync/launch/ imported) that this run is one of: launched by
    torchrun / accelerate launch (`launched`), asked for one in-process worker (`no_ray`), its config."""
    package = importlib.import_module("allsync.launch")
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"allsync.launch.{module.name}")
    for mode in LAUNCH_MODES:
        if mode.chosen(launched, no_ray, config):
            return mode
    raise ValueError(f"no launch mode for launched={launched}, no_ray={no_ray}")
