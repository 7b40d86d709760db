"""What every launch mode shares: the `WorkerGroup` protocol the training loop drives, the failures it raises, and
the registry that picks a mode for a run.

A launch mode is a class registered with `@register_launch_mode` (in a module of allsync/launch/, or of the run's
own `run.imports`); besides the `WorkerGroup` methods it provides

    name: str                                    what `run.launch` calls it (one mode a name)
    chosen(launched, no_ray, config) -> bool     (static) whether this run is one of its
    order: int                                   (the modes of allsync/launch/ only) with run.launch unset, the
                                                 first of them in this order whose `chosen` says so runs
    refusal(config, no_ray, world_size) -> str | None
        (static) what this mode cannot run, said before any work (world_size: the launcher's WORLD_SIZE, or None)
    run(config, problems, max_model_len, train, resume, out_dir) -> int
        (class method) start the workers and run `train(group, resume, own)` (recipes/dapo.py's loop) with them,
        restarting after a lost worker as the mode can; returns the process's exit code
"""

from __future__ import annotations

import importlib
import pkgutil
import random
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


# where free_port draws from: below Linux's ephemeral range (32768-60999, the ports the kernel hands out for
# outgoing connections and bind(0)) and above Ray's worker ports (10002-19999), skipping torch's default 29500
PORTS = [p for p in range(20000, 32768) if not 29400 <= p < 29600]


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port on `host` nothing listens on, for a TCP store another process binds later. Drawn at random from
    PORTS, never from the ephemeral range: between this pick and that bind (seconds, while workers start), the
    kernel gives ephemeral ports to every outgoing connection and bind(0) on the machine (Ray's processes make
    many), which a port found by bind(0) here could go to. Where the ephemeral range starts below PORTS' end
    (net.ipv4.ip_local_port_range), only the ports below it are drawn."""
    low = ephemeral_start()
    ports = [p for p in PORTS if p < low] or PORTS
    rng = rng or random.SystemRandom()
    for port in rng.sample(ports, min(len(ports), 64)):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port on {host} among 64 drawn from {ports[0]}-{ports[-1]}")


def ephemeral_start(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read, Linux's default)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


LAUNCH_MODES: dict[str, type] = {}  # name -> mode class


def register_launch_mode(cls: type) -> type:
    """Class decorator: `cls` is a launch mode named `cls.name` (run.launch). A name registered twice is refused, and
    so is an `order` outside allsync/launch/: the automatic choice among the built-in modes never depends on which
    modules a run imported, or in which order."""
    if cls.name in LAUNCH_MODES:
        raise ValueError(
            f"launch mode {cls.name!r} is registered twice ({LAUNCH_MODES[cls.name].__module__} and {cls.__module__})"
        )
    if hasattr(cls, "order") and not cls.__module__.startswith(f"{__package__}."):
        raise ValueError(
            f"launch mode {cls.name!r} ({cls.__module__}) has an order: only allsync/launch/'s modes are chosen "
            "automatically; a run picks another one by name (run.launch)"
        )
    LAUNCH_MODES[cls.name] = cls
    return cls


def launch_modes() -> dict[str, type]:
    """The registry once every module of allsync/launch/ is imported (a run's own are imported by run.imports)."""
    package = importlib.import_module("allsync.launch")
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"allsync.launch.{module.name}")
    return LAUNCH_MODES


def launch_mode(launched: bool, no_ray: bool, config) -> type:
    """The mode config.run.launch names, which must be one this run can be (its `chosen`); with run.launch unset,
    the first of allsync/launch/'s modes (in their `order`) that this run is one of: launched by torchrun /
    accelerate launch (`launched`), asked for one in-process worker (`no_ray`), its config. ConfigError naming
    run.launch otherwise."""
    from allsync.config.errors import ConfigError

    modes = launch_modes()
    name = config.run.launch
    if name is not None:
        if name not in modes:
            raise ConfigError(f"run.launch = {name!r}: use one of {', '.join(sorted(modes))} (or leave it unset)")
        if not modes[name].chosen(launched, no_ray, config):
            raise ConfigError(
                f"run.launch = {name}: this run cannot be one (started by a launcher: {launched}, --no-ray: "
                f"{no_ray}, parallel workers: {config.parallel.workers}); {modes[name].__doc__.splitlines()[0]}"
            )
        return modes[name]
    automatic = sorted((m for m in modes.values() if hasattr(m, "order")), key=lambda m: m.order)
    for mode in automatic:
        if mode.chosen(launched, no_ray, config):
            return mode
    raise ValueError(f"no launch mode for launched={launched}, no_ray={no_ray}")
