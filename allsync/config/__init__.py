"""Run configuration: YAML -> nested dataclasses, validated before any work starts.

An unknown key, a value of the wrong type, or an impossible combination is a `ConfigError` that names
the file and the dotted key (with a suggestion for a misspelt key); nothing falls back to a silent default.

One module per section, its dataclass and its own check beside each other (model: model and lora; rollout;
algorithm; optim; parallel; reward; run: run and health), `run_config` the whole, `parsing` YAML to RunConfig and
`checks` the rules across sections. The task and producer sections are the settings classes of their registries
(allsync/tasks/, allsync/producers/).
"""

from allsync.config.algorithm import AlgorithmSection, OverlongSection, TISSection
from allsync.config.checks import VLLM_LORA_RANKS, check_kv_room, check_reply_budget, config_with_model_checks
from allsync.config.errors import ConfigError
from allsync.config.model import WARM_START_STEPS, LoRASection, ModelSection, QuantSection
from allsync.config.optim import OptimSection
from allsync.config.parallel import ParallelSection
from allsync.config.parsing import load_config, load_config_for_planning, parse_config, read_yaml, validate
from allsync.config.reward import LengthRewardSection, RewardSection
from allsync.config.rollout import RolloutSection
from allsync.config.run import HealthSection, RunSection, import_extensions
from allsync.config.run_config import RunConfig

__all__ = [
    "AlgorithmSection",
    "ConfigError",
    "HealthSection",
    "LengthRewardSection",
    "LoRASection",
    "ModelSection",
    "OptimSection",
    "OverlongSection",
    "ParallelSection",
    "QuantSection",
    "RewardSection",
    "RolloutSection",
    "RunConfig",
    "RunSection",
    "TISSection",
    "VLLM_LORA_RANKS",
    "WARM_START_STEPS",
    "check_kv_room",
    "check_reply_budget",
    "config_with_model_checks",
    "import_extensions",
    "load_config",
    "load_config_for_planning",
    "parse_config",
    "read_yaml",
    "validate",
]
