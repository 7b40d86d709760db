"""Starting the workers: Ray actors in a placement group (one bundle per device), in-process, or as the
processes a launcher started (SPMD: torchrun / accelerate launch, `SPMDGroup`).

Each worker is an `RLWorker`. The controller (recipes/dapo.py) sees one interface whatever the mode:
`call(method, *args)` runs the method on every worker and returns every worker's result; `call_for_rank0`
runs it on every worker (they may take part in a collective) and returns rank 0's; `is_controller` says
whether this process writes logs, checkpoints and exports; `agree(value)` is the controller's value on
every process. Two layouts drive the Ray workers step by step:
- `WorkerGroup` (colocated, all-sync): every worker generates its share, then every worker trains; the
  controller only sends step numbers and receives metric sums. Gradients move between workers over
  torch.distributed (gloo on CPU), never through the controller.
- `DisaggregatedGroup` (the baseline all-sync is measured against): half the workers only generate, the
  other half only train; samples go from generators to trainers and the adapter back every step, so each
  half waits while the other works.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import threading
import time

import torch

from allsync.config import RunConfig
from allsync.tasks import Problem


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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


def gather_or_stop(refs: list, ranks: list[int], method: str, workers: list, timeout: float | None = None) -> list:
    """ray.get of one call per worker, in rank order, that does not wait for the others after a failure:
    the first worker to raise (or die) stops every worker (ray.kill), since the others may be blocked in
    a collective that will never complete (gloo would wait for its timeout), and WorkerFailure names it.
    timeout: seconds for every answer; past it every worker is stopped and WorkerTimeout names the silent."""
    import ray

    pending = {ref: rank for ref, rank in zip(refs, ranks)}
    deadline = time.time() + timeout if timeout is not None else None
    while pending:
        ready, _ = ray.wait(
            list(pending), num_returns=1, timeout=None if deadline is None else max(deadline - time.time(), 0.0)
        )
        if not ready:
            for w in workers:
                ray.kill(w)
            raise WorkerTimeout(sorted(pending.values()), method, timeout)
        rank = pending.pop(ready[0])
        try:
            ray.get(ready[0])
        except Exception as exc:  # RayTaskError wraps the worker's exception; ActorDiedError for a lost process
            for w in workers:
                ray.kill(w)
            raise WorkerFailure(rank, method, getattr(exc, "cause", None) or exc) from exc
    return ray.get(refs)


class WorkerGroup:
    """N workers behind one call interface: `call(method, *args)` runs it on every worker, returns all results.
    Under Ray, the first worker that fails stops them all (WorkerFailure names its rank and error)."""

    def __init__(
        self,
        config: RunConfig,
        problems: list[Problem],
        use_ray: bool = True,
        gpus_per_worker: float = 0,
        max_model_len: int | None = None,
        attempt: int = 0,
    ):
        """attempt: how many times the run has restarted its workers (allsync.health.faults: drills fire in attempt 0)."""
        self.size = config.parallel.workers
        self.step_timeout = config.run.step_timeout
        self.use_ray = use_ray and self.size > 1
        self.failed = False
        if not self.use_ray:
            from allsync.worker import RLWorker

            self.workers = [RLWorker(config, problems, max_model_len=max_model_len, attempt=attempt)]
            self.size = 1
            return
        self.placement, start = start_placement(self.size, gpus_per_worker)
        address = rendezvous_address(self.placement)
        self.workers = [
            start(
                i,
                config,
                problems,
                rank=i,
                world_size=self.size,
                dist_address=address,
                max_model_len=max_model_len,
                attempt=attempt,
            )
            for i in range(self.size)
        ]

    is_controller = True  # the Ray driver is the only controller process

    def call(self, method: str, *args) -> list:
        return self.call_ranks(list(range(self.size)), method, *args)

    def call_for_rank0(self, method: str, *args):
        return self.call(method, *args)[0]

    @staticmethod
    def agree(value):
        return value

    def call_rank0(self, method: str, *args):
        return self.call_ranks([0], method, *args)[0]

    def call_ranks(self, ranks: list[int], method: str, *args, timeout: float | None = None) -> list:
        if not self.use_ray:
            return [getattr(self.workers[0], method)(*args)]
        refs = [getattr(self.workers[r], method).remote(*args) for r in ranks]
        try:
            return gather_or_stop(refs, ranks, method, self.workers, timeout)
        except WorkerFailure:
            self.failed = True
            raise

    def step(self, step: int) -> list[dict]:
        """One all-sync step on every worker; per-worker metric sums. A worker that dies, or no answer within
        run.step_timeout, stops every worker (WorkerFailure / WorkerTimeout)."""
        return self.call_ranks(list(range(self.size)), "step", step, timeout=self.step_timeout)

    def shutdown(self) -> None:
        """Stop the workers (once; later calls do nothing)."""
        if self.workers is None:
            return
        if not self.failed:
            self.call("shutdown")
        if self.use_ray:
            stop_placement(self.workers, self.placement)
        self.workers = None


class SPMDGroup:
    """This process is one worker of a launcher's world (torchrun, accelerate launch): rank, world size and
    local rank come from accelerate's PartialState, which reads the launcher's environment and initializes
    torch.distributed's default group (gloo on CPU, NCCL on GPUs). No Ray.

    Every process runs the controller's code (recipes/dapo.py) in step; `call` runs the method here with rank
    0's arguments (so every rank acts on the controller's checkpoint directory, problems and step) and
    all-gathers the results, so every rank takes the same decisions; rank 0 alone writes."""

    def __init__(self, config: RunConfig, problems: list[Problem], max_model_len: int | None = None, attempt: int = 0):
        """attempt: the elastic launcher's restart count (TORCHELASTIC_RESTART_COUNT)."""
        from allsync.worker import RLWorker

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
            from allsync.distributed import disconnect

            disconnect()


def init_attempt_group(backend: str) -> None:
    """Under torchrun (TORCHELASTIC_RESTART_COUNT set), the default process group on a store prefix of its own per
    restart: the launcher's store keeps the previous attempt's keys, and gloo would read the dead processes'
    addresses from them and fail to connect (seen with torch 2.13 and `torchrun --max-restarts`)."""
    import torch.distributed as dist

    from allsync.distributed import TIMEOUT

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


def start_placement(size: int, gpus_per_worker: float = 0):
    """A placement group of `size` bundles (1 CPU [+ GPUs] each) and a function starting an RLWorker actor in slot
    s = 0..size-1: the bundle `ranks_to_bundles` gives rank s, so that each node's slots are consecutive."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        # the worker's imports (torch, transformers: ~3 s) overlap Ray's start, which mostly waits for its processes
        importing = threading.Thread(target=_import_quietly, args=("allsync.worker",), daemon=True)
        importing.start()
        if os.environ.get("RAY_ADDRESS"):  # a cluster started with `ray start` (see README, "Scaling out")
            ray.init(log_to_driver=True, configure_logging=False)
        else:  # a Ray instance of this run's own, even when another runs on the machine (it is joined only by name)
            ray.init(
                address="local",
                num_cpus=max(size, 1),
                include_dashboard=False,
                log_to_driver=True,
                configure_logging=False,
            )
        importing.join()
    from allsync.worker import RLWorker  # raises here, in the caller's thread, if the import failed

    bundle = {"CPU": 1, **({"GPU": gpus_per_worker} if gpus_per_worker else {})}
    placement = placement_group([bundle] * size, strategy="PACK")
    ray.get(placement.ready())
    node_of_bundle = placement_group_table(placement)["bundles_to_node_id"]
    bundle_of_rank = ranks_to_bundles(node_of_bundle)
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    print(placement_summary([node_of_bundle[b] for b in bundle_of_rank], address), flush=True)
    actor = ray.remote(num_cpus=1, num_gpus=gpus_per_worker)(RLWorker)

    def start(slot: int, *args, **kwargs):
        strategy = PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=bundle_of_rank[slot])
        return actor.options(scheduling_strategy=strategy).remote(*args, threads=WORKER_THREADS, **kwargs)

    return placement, start


def ranks_to_bundles(node_of_bundle: dict[int, str]) -> list[int]:
    """The bundle of each rank such that every node's ranks are consecutive: nodes in the order of their first
    bundle, a node's bundles in order. An expert-parallel group (consecutive ranks) of at most a node's GPUs then
    stays inside that node, and rank 0 keeps bundle 0. {0: A, 1: B, 2: A, 3: B} -> [0, 2, 1, 3]."""
    bundles_of_node: dict[str, list[int]] = {}
    for b in sorted(node_of_bundle):
        bundles_of_node.setdefault(node_of_bundle[b], []).append(b)
    return [b for bundles in bundles_of_node.values() for b in bundles]


def rank_ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs)


def placement_summary(node_of_rank: list[str], address: dict[str, str]) -> str:
    """Where the workers run, nodes told apart by Ray node id (several may share an address): "Ray: 16 workers on
    2 nodes: 10.0.0.1 ranks 0-7; 10.0.0.2 ranks 8-15"."""
    ranks_of_node: dict[str, list[int]] = {}
    for rank, node in enumerate(node_of_rank):
        ranks_of_node.setdefault(node, []).append(rank)
    where = "; ".join(f"{address.get(node, node)} ranks {rank_ranges(ranks)}" for node, ranks in ranks_of_node.items())
    plural = "s" if len(ranks_of_node) > 1 else ""
    return f"Ray: {len(node_of_rank)} workers on {len(ranks_of_node)} node{plural}: {where}"


def _import_quietly(module: str) -> None:
    """Import `module` for its side effect (sys.modules); a failure is left for the caller's own import to raise."""
    try:
        importlib.import_module(module)
    except Exception:
        pass


def rendezvous_address(placement) -> str:
    """tcp://ip:port of a free port on the node of bundle 0, rank 0's (it hosts the workers' TCP store there), so
    workers on other nodes of a Ray cluster reach it. Found here when that node is this process's (a task would
    cost a worker process start), else by a task on that node."""
    import ray
    from ray.util.placement_group import placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if placement_group_table(placement)["bundles_to_node_id"][0] == ray.get_runtime_context().get_node_id():
        return this_node_address()
    strategy = PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=0)
    return ray.get(ray.remote(num_cpus=0)(this_node_address).options(scheduling_strategy=strategy).remote())


def this_node_address() -> str:
    """tcp://ip:port of a free port on the node this runs on (Ray's address for the node)."""
    import ray

    return f"tcp://{ray.util.get_node_ip_address()}:{free_port('0.0.0.0')}"


def stop_placement(workers, placement) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    for w in workers:
        ray.kill(w)
    remove_placement_group(placement)


# keys every per-worker metric dict carries (see allsync.metrics.aggregate); a worker reports 0 for a phase it does not run
ROLLOUT_KEYS = (
    "samples_generated",
    "reward_sum",
    "correct_sum",
    "response_tokens",
    "truncated",
    "staleness_max",
    "groups_generated",
    "sampling_rounds",
    "groups_kept",
    "groups_wanted",
    "sampling_cap_hits",
    "reward_errors",
)
TRAIN_KEYS = (
    "loss_sum",
    "clipfrac_high_sum",
    "clipfrac_low_sum",
    "kl_sum",
    "entropy_sum",
    "kl_ref_sum",
    "logprob_gap",
    "trained_samples",
    "trained_tokens",
    "nan_steps",
    "optimizer_steps",
    "empty_minibatches",
    "grad_norm",
)


def split_groups(samples: list, group_index: torch.Tensor, parts: int) -> list[tuple[list, torch.Tensor]]:
    """Whole groups dealt into `parts` contiguous chunks (as even as possible), group ids renumbered from 0."""
    groups = sorted(set(group_index.tolist()))
    bounds = [round(k * len(groups) / parts) for k in range(parts + 1)]
    out = []
    for k in range(parts):
        mine = {g: j for j, g in enumerate(groups[bounds[k] : bounds[k + 1]])}
        rows = [i for i, g in enumerate(group_index.tolist()) if g in mine]
        out.append(
            ([samples[i] for i in rows], torch.tensor([mine[int(group_index[i])] for i in rows], dtype=torch.long))
        )
    return out


class DisaggregatedGroup:
    """Synchronous RL with separate roles: workers/2 generators and workers/2 trainers (Ray actors).

    Per step: generators make the whole batch (prompts strided over them) -> samples to the trainers (whole
    groups each) -> trainers update with all-reduced gradients -> trainer 0's adapter goes to every
    generator. Still on-policy (staleness 0), but each half idles while the other half works.
    """

    def __init__(self, config: RunConfig, problems: list[Problem], gpus_per_worker: float = 0):
        self.size = config.parallel.workers
        self.config = config
        n_gen = self.size // 2
        self.placement, start = start_placement(self.size, gpus_per_worker)
        address = rendezvous_address(self.placement)
        self.trainers = [
            start(i, config, problems, rank=i, world_size=self.size - n_gen, dist_address=address)
            for i in range(self.size - n_gen)
        ]
        self.generators = [
            start(self.size - n_gen + i, config, problems, rank=i, world_size=n_gen) for i in range(n_gen)
        ]
        self.workers = self.trainers + self.generators
        self.version = 0
        self.sync_bytes = self._sync()  # generators start from the trainers' initial adapter

    def _sync(self) -> list[int]:
        tensors = self.trainers[0].adapter_tensors.remote()
        return self._gather(
            [g.receive_adapter.remote(tensors, self.version) for g in self.generators],
            "receive_adapter",
            self.generators,
        )

    def _gather(self, refs: list, method: str, workers: list) -> list:
        """Results in order; the first worker that fails stops them all (WorkerFailure names its index in
        `self.workers`: trainers first, then generators)."""
        return gather_or_stop(refs, [self.workers.index(w) for w in workers], method, self.workers)

    def step(self, step: int) -> list[dict]:
        """One synchronous step; per-worker metric sums, trainers first."""
        wall0 = time.time()
        per_generator = self.config.rollout.prompts_per_step // len(self.generators)
        rollouts = self._gather(
            [g.rollout_phase.remote(per_generator) for g in self.generators], "rollout_phase", self.generators
        )
        samples, index, offset = [], [], 0
        for s, g, _ in rollouts:
            samples += s
            index.append(g + offset)
            offset += int(g.max()) + 1 if len(g) else 0
        group_index = torch.cat(index) if index else torch.zeros(0, dtype=torch.long)
        parts = split_groups(samples, group_index, len(self.trainers))
        trained = self._gather(
            [t.train_phase.remote(s, g) for t, (s, g) in zip(self.trainers, parts)], "train_phase", self.trainers
        )
        self.version += 1
        received = self._sync()
        reports = self._gather([w.busy_report.remote(wall0) for w in self.workers], "busy_report", self.workers)
        out = []
        for i, report in enumerate(reports):
            m = dict.fromkeys(ROLLOUT_KEYS + TRAIN_KEYS, 0)
            if i < len(self.trainers):
                m.update(trained[i])
            else:
                m.update(rollouts[i - len(self.trainers)][2])
                m["sync_bytes"] = received[i - len(self.trainers)]
            m.setdefault("sync_bytes", 0)
            out.append({**m, **report})
        return out

    def call(self, method: str, *args) -> list:
        return self._gather([getattr(w, method).remote(*args) for w in self.workers], method, self.workers)

    def shutdown(self) -> None:
        self.call("shutdown")
        stop_placement(self.workers, self.placement)
