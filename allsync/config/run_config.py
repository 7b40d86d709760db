"""RunConfig: every section of a run, the task and producer sections built from their registries."""

from __future__ import annotations

from dataclasses import dataclass, field


from allsync.producers.registry import ProducerSettings, default_producer
from allsync.tasks import ArithmeticTask, TaskSettings
from allsync.config.algorithm import AlgorithmSection
from allsync.config.model import LoRASection, ModelSection
from allsync.config.optim import OptimSection
from allsync.config.parallel import ParallelSection
from allsync.config.reward import RewardSection
from allsync.config.rollout import RolloutSection
from allsync.config.run import HealthSection, RunSection


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    lora: LoRASection = field(default_factory=LoRASection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    optim: OptimSection = field(default_factory=OptimSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    task: TaskSettings = field(default_factory=ArithmeticTask)  # the settings class of task.name (allsync.tasks)
    reward: RewardSection = field(default_factory=RewardSection)
    run: RunSection = field(default_factory=RunSection)
    health: HealthSection = field(default_factory=HealthSection)
    producer: ProducerSettings = field(
        default_factory=default_producer
    )  # the settings class of producer.kind (allsync.producers)

    def __post_init__(self):
        if self.reward.name is None and self.reward.function is None:  # the task's own reward (allsync.tasks)
            self.reward.name = self.task.default_reward
