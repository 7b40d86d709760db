"""Ray actors in a placement group, one bundle per device (`RayGroup`), and the helpers the Ray layouts share:
placement (each node's ranks consecutive), the rendezvous address, and gathering results so that the first worker
that fails stops them all."""

from __future__ import annotations

import importlib
import os
import threading
import time

from allsync.config import RunConfig
from allsync.launch.group import WORKER_THREADS, WorkerFailure, WorkerTimeout, free_port, register_launch_mode
from allsync.launch.supervise import supervise
from allsync.tasks import Problem


@register_launch_mode
class RayGroup:
    """allsync.launch.group.WorkerGroup over N Ray actors (colocated, all-sync): every worker generates its share,
    then every worker trains; the controller only sends step numbers and receives metric sums. Gradients move
    between workers over torch.distributed (gloo on CPU), never through the controller. The first worker that
    fails stops them all (WorkerFailure names its rank and error)."""

    name = "ray"
    order = 2

    def __init__(
        self,
        config: RunConfig,
        problems: list[Problem],
        gpus_per_worker: float = 0,
        max_model_len: int | None = None,
        attempt: int = 0,
    ):
        """attempt: how many times the run has restarted its workers (allsync.health.faults: drills fire in attempt 0)."""
        self.size = config.parallel.workers
        self.step_timeout = config.run.step_timeout
        self.failed = False
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

    @staticmethod
    def chosen(launched: bool, no_ray: bool, config: RunConfig) -> bool:
        return not launched

    @staticmethod
    def refusal(config: RunConfig, no_ray: bool, world_size: int | None) -> str | None:
        """Ray runs any colocated config (a restart replaces a lost actor) but one vLLM engine over the workers, which
        vLLM builds from a launcher's environment (its external launcher: RANK, WORLD_SIZE and the default process
        group torchrun / accelerate launch set up)."""
        if config.rollout.engine_expert_parallel:
            return (
                "rollout.engine_expert_parallel under Ray: the one vLLM engine over the workers is vLLM's external "
                "launcher, which torchrun or accelerate launch starts (one process per GPU); launch the recipe with "
                "torchrun, or set engine_expert_parallel: false"
            )
        return None

    @classmethod
    def run(cls, config, problems, max_model_len, train, resume: bool, out_dir) -> int:
        gpus = 1 if config.parallel.resolved_device() == "cuda" else 0  # one bundle (and one GPU) per worker
        make = lambda attempt: cls(config, problems, gpus, max_model_len, attempt)  # noqa: E731
        return supervise(config, resume, make, train, out_dir)

    def call(self, method: str, *args) -> list:
        return self.call_ranks(list(range(self.size)), method, *args)

    def call_for_rank0(self, method: str, *args):
        return self.call(method, *args)[0]

    @staticmethod
    def agree(value):
        return value

    def call_ranks(self, ranks: list[int], method: str, *args, timeout: float | None = None) -> list:
        """The method on the workers of `ranks` only; their results in that order."""
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
        stop_placement(self.workers, self.placement)
        self.workers = None


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


def start_placement(size: int, gpus_per_worker: float = 0):
    """A placement group of `size` bundles (1 CPU [+ GPUs] each) and a function starting an RLWorker actor in slot
    s = 0..size-1: the bundle `ranks_to_bundles` gives rank s, so that each node's slots are consecutive."""
    import ray
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    own = not os.environ.get("RAY_ADDRESS")
    if ray.is_initialized() and ray.cluster_resources().get("CPU", 0) < size:
        if not own:  # a placement group the cluster can never hold would wait forever
            raise RuntimeError(
                f"the Ray cluster at RAY_ADDRESS has {ray.cluster_resources().get('CPU', 0):g} CPUs and this run needs "
                f"{size} (one per worker): start it with more (`ray start --num-cpus`) or give fewer workers"
            )
        ray.shutdown()  # this process's own Ray, started for a smaller group earlier: started again for this one
    if not ray.is_initialized():
        # the worker's imports (torch, transformers: ~3 s) overlap Ray's start, which mostly waits for its processes
        importing = threading.Thread(target=_import_quietly, args=("allsync.run.worker",), daemon=True)
        importing.start()
        if not own:  # a cluster started with `ray start` (see docs/scaling.md)
            ray.init(log_to_driver=True, configure_logging=False)
        else:  # a Ray instance of this run's own, even when another runs on the machine (it is joined only by name)
            start_own_ray(max(size, 1))
        importing.join()
    from allsync.run.worker import RLWorker  # raises here, in the caller's thread, if the import failed

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


RAY_START_ATTEMPTS = 3


def start_own_ray(cpus: int, attempts: int = RAY_START_ATTEMPTS) -> None:
    """ray.init of a local instance of `cpus` CPUs, started again (at most `attempts` times in all) when Ray gives
    up on its own processes' start: it waits a fixed 30 s for its raylet to register ("The current node timed out
    during startup"), which a loaded machine can pass; the other errors are raised at once."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(
                address="local", num_cpus=cpus, include_dashboard=False, log_to_driver=True, configure_logging=False
            )
            return
        except Exception as exc:  # Ray raises a bare Exception for it
            if not ray_start_timed_out(exc) or attempt == attempts:
                raise
            print(f"Ray's start timed out ({exc}); starting it again ({attempt + 1} of {attempts})", flush=True)
            ray.shutdown()


def ray_start_timed_out(exc: BaseException) -> bool:
    """Whether ray.init's error is its own start's wait running out (TimeoutError, or Ray's bare Exception)."""
    return isinstance(exc, TimeoutError) or "timed out during startup" in str(exc)


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
