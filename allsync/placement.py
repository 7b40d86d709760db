"""Starting the colocated workers: Ray actors in a placement group (one bundle per device), or in-process.

Each actor is an `RLWorker`; the controller only sends small things (step numbers, problem lists,
checkpoint paths) and receives metric sums. Gradients move between workers over torch.distributed
(gloo on CPU), never through the controller.
"""

from __future__ import annotations

import socket

from allsync.config import RunConfig
from allsync.tasks import Problem


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerGroup:
    """N workers behind one call interface: `call(method, *args)` runs it on every worker, returns all results."""

    def __init__(self, config: RunConfig, problems: list[Problem], use_ray: bool = True, gpus_per_worker: float = 0):
        self.size = config.parallel.workers
        self.use_ray = use_ray and self.size > 1
        if not self.use_ray:
            from allsync.worker import RLWorker

            self.workers = [RLWorker(config, problems)]
            self.size = 1
            return
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from allsync.worker import RLWorker

        if not ray.is_initialized():
            ray.init(num_cpus=max(self.size, 1), include_dashboard=False, log_to_driver=True, configure_logging=False)
        bundle = {"CPU": 1, **({"GPU": gpus_per_worker} if gpus_per_worker else {})}
        self.placement = placement_group([bundle] * self.size, strategy="PACK")
        ray.get(self.placement.ready())
        actor = ray.remote(num_cpus=1, num_gpus=gpus_per_worker)(RLWorker)
        address = f"tcp://127.0.0.1:{free_port()}"
        self.workers = [
            actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=i))
            .remote(config, problems, rank=i, world_size=self.size, dist_address=address, threads=1)
            for i in range(self.size)
        ]

    def call(self, method: str, *args) -> list:
        if not self.use_ray:
            return [getattr(self.workers[0], method)(*args)]
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def call_rank0(self, method: str, *args):
        return self.call_ranks([0], method, *args)[0]

    def call_ranks(self, ranks: list[int], method: str, *args) -> list:
        if not self.use_ray:
            return [getattr(self.workers[0], method)(*args)]
        import ray

        return ray.get([getattr(self.workers[r], method).remote(*args) for r in ranks])

    def shutdown(self) -> None:
        self.call("shutdown")
        if self.use_ray:
            import ray

            from ray.util.placement_group import remove_placement_group

            for w in self.workers:
                ray.kill(w)
            remove_placement_group(self.placement)
