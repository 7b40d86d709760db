"""One worker in this process (`--no-ray`, or a run of one worker): no Ray, no process group."""

from __future__ import annotations

from allsync.config import RunConfig
from allsync.launch.group import register_launch_mode
from allsync.launch.supervise import supervise
from allsync.tasks import Problem


@register_launch_mode
class LocalGroup:
    """allsync.launch.group.WorkerGroup over one RLWorker in this process."""

    name = "local"
    order = 1
    is_controller = True

    def __init__(self, config: RunConfig, problems: list[Problem], max_model_len: int | None = None, attempt: int = 0):
        """attempt: how many times the run has restarted its workers (allsync.health.faults: drills fire in attempt 0)."""
        from allsync.run.worker import RLWorker

        self.size = 1
        self.worker = RLWorker(config, problems, max_model_len=max_model_len, attempt=attempt)

    @staticmethod
    def chosen(launched: bool, no_ray: bool, config: RunConfig) -> bool:
        return not launched and (no_ray or config.parallel.workers == 1)

    @staticmethod
    def refusal(config: RunConfig, no_ray: bool, world_size: int | None) -> str | None:
        """One worker in this process: nothing can restart it, and it holds every expert. (--no-ray with restarts set
        is no contradiction: the recipe says the flag turns them off.)"""
        r = config.run
        if not no_ray and (r.max_restarts or r.step_timeout is not None):
            return (
                f"run.max_restarts = {r.max_restarts} / run.step_timeout = {r.step_timeout} with one worker, which runs "
                "in this process: a lost worker would be this process; use Ray with 2+ workers or torchrun "
                "--max-restarts, or set them to 0 / null"
            )
        if config.rollout.engine_expert_parallel:
            return "rollout.engine_expert_parallel with --no-ray: one in-process worker; launch with torchrun"
        if config.parallel.expert_parallel > 1:
            return (
                f"parallel.expert_parallel = {config.parallel.expert_parallel} with --no-ray: one in-process worker "
                "holds every expert; drop --no-ray or use 1"
            )
        return None

    @classmethod
    def run(cls, config, problems, max_model_len, train, resume: bool, out_dir) -> int:
        make = lambda attempt: cls(config, problems, max_model_len, attempt)  # noqa: E731
        return supervise(config, resume, make, train, out_dir)

    def call(self, method: str, *args) -> list:
        return [getattr(self.worker, method)(*args)]

    def call_for_rank0(self, method: str, *args):
        return self.call(method, *args)[0]

    @staticmethod
    def agree(value):
        return value

    def step(self, step: int) -> list[dict]:
        return self.call("step", step)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
