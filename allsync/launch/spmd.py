"""SPMD: this process is one worker of a launcher's world (torchrun, accelerate launch), the controller's code
running in every process in step (`SPMDGroup`)."""

from __future__ import annotations

import os
import sys
import threading

from allsync.config import RunConfig
from allsync.launch.group import EXIT_RESTART, WORKER_THREADS, register_launch_mode
from allsync.distributed.process_groups import TIMEOUT, disconnect
from allsync.tasks import Problem


def spmd_environment() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when a launcher (torchrun, accelerate launch) started this process."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def elastic_attempt() -> int:
    """How many times an elastic launcher has restarted this run (TORCHELASTIC_RESTART_COUNT; 0 without one)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


@register_launch_mode
class SPMDGroup:
    """allsync.launch.group.WorkerGroup in which this process is one worker of a launcher's world (torchrun, accelerate launch): rank, world size and
    local rank come from accelerate's PartialState, which reads the launcher's environment and initializes
    torch.distributed's default group (gloo on CPU, NCCL on GPUs). No Ray.

    Every process runs the controller's code (recipes/dapo.py) in step; `call` runs the method here with rank
    0's arguments (so every rank acts on the controller's checkpoint directory, problems and step) and
    all-gathers the results, so every rank takes the same decisions; rank 0 alone writes."""

    name = "spmd"
    order = 0

    def __init__(self, config: RunConfig, problems: list[Problem], max_model_len: int | None = None, attempt: int = 0):
        """attempt: the elastic launcher's restart count (TORCHELASTIC_RESTART_COUNT)."""
        from allsync.run.worker import RLWorker

        state = spmd_state(config)
        self.rank, self.size = state.process_index, state.num_processes
        self.is_controller = self.rank == 0
        self.step_timeout = config.run.step_timeout
        self.worker = RLWorker(
            config,
            problems,
            rank=self.rank,
            world_size=self.size,
            launcher=True,
            max_model_len=max_model_len,
            threads=WORKER_THREADS,
            attempt=attempt,
        )

    @staticmethod
    def chosen(launched: bool, no_ray: bool, config: RunConfig) -> bool:
        return launched

    @staticmethod
    def refusal(config: RunConfig, no_ray: bool, world_size: int | None) -> str | None:
        """A launcher's world must be the config's workers, and every launched process is already one worker."""
        if world_size != config.parallel.workers:
            return (
                f"the launcher started {world_size} processes (WORLD_SIZE) but parallel.nodes x workers_per_node = "
                f"{config.parallel.workers}; make them equal"
            )
        if no_ray:
            return (
                "--no-ray under torchrun / accelerate launch: every launched process is already one worker and Ray is "
                "never started; drop --no-ray"
            )
        return None

    @classmethod
    def run(cls, config, problems, max_model_len, train, resume: bool, out_dir) -> int:
        """`train` in this launched process. An elastic launcher's restart (after a lost peer or a step timeout)
        resumes by itself, up to run.max_restarts (exit code 4 past it). A collective that fails because a peer was
        lost ends the process with EXIT_RESTART (as a step past run.step_timeout does), so that
        `torchrun --max-restarts N` restarts the run."""
        import torch.distributed as dist

        attempt = elastic_attempt()
        if attempt > config.run.max_restarts:
            if spmd_environment()[0] == 0:
                print(
                    f"error: restart {attempt} by the elastic launcher, beyond run.max_restarts = "
                    f"{config.run.max_restarts}; stopped",
                    file=sys.stderr,
                )
            return 4
        group = cls(config, problems, max_model_len=max_model_len, attempt=attempt)
        try:
            return train(group, resume, None)
        except dist.DistError as exc:
            print(
                f"error: rank {group.rank}: a collective failed ({type(exc).__name__}: {str(exc)[:300]}): a peer was "
                f"lost; exiting with code {EXIT_RESTART} so that an elastic launcher restarts the run",
                file=sys.stderr,
            )
            return EXIT_RESTART
        finally:
            group.shutdown()

    def _rank0_args(self, args: tuple) -> tuple:
        import torch.distributed as dist

        box = [args]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def call(self, method: str, *args) -> list:
        import torch.distributed as dist

        result = getattr(self.worker, method)(*self._rank0_args(args))
        results = [None] * self.size
        dist.all_gather_object(results, result)
        return results

    def call_for_rank0(self, method: str, *args):
        result = getattr(self.worker, method)(*self._rank0_args(args))
        return result if self.is_controller else None

    def agree(self, value):
        return self._rank0_args((value,))[0]

    def step(self, step: int) -> list[dict]:
        """One step in every process. Past run.step_timeout (this process hung, or waits for a hung peer) the
        process exits with EXIT_RESTART, since a collective that a lost peer never joins cannot be cancelled."""
        watchdog = None
        if self.step_timeout is not None:
            watchdog = threading.Timer(
                self.step_timeout,
                exit_for_restart,
                (self.rank, f"step {step} passed run.step_timeout = {self.step_timeout:g} s"),
            )
            watchdog.daemon = True
            watchdog.start()
        try:
            return self.call("step", step)
        finally:
            if watchdog is not None:
                watchdog.cancel()

    def shutdown(self) -> None:
        """Stop the worker (once; later calls do nothing)."""
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
            disconnect()


def init_attempt_group(backend: str) -> None:
    """Under torchrun (TORCHELASTIC_RESTART_COUNT set), the default process group on a store prefix of its own per
    restart: the launcher's store keeps the previous attempt's keys, and gloo would read the dead processes'
    addresses from them and fail to connect (seen with torch 2.13 and `torchrun --max-restarts`)."""
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or dist.is_initialized():
        return
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # else rank 0 hosts it
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=not agent_hosts and rank == 0,
        timeout=TIMEOUT,
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"allsync/attempt_{attempt}", store),
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
    )


def exit_for_restart(rank: int, reason: str) -> None:
    """Leave at once with EXIT_RESTART (from any thread: a hung main thread cannot be interrupted)."""
    print(
        f"error: rank {rank}: {reason}; exiting with code {EXIT_RESTART} so that an elastic launcher "
        "(torchrun --max-restarts N) restarts the run from its newest good checkpoint",
        file=sys.stderr,
        flush=True,
    )
    os._exit(EXIT_RESTART)


def spmd_state(config: RunConfig):
    """accelerate's view of this launched process (initializes the default process group once)."""
    from accelerate import PartialState

    init_attempt_group(config.parallel.resolved_backend())
    return PartialState(cpu=config.parallel.resolved_device() == "cpu", backend=config.parallel.resolved_backend())
