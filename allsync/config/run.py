"""The `run:` and `health:` sections: steps, evaluation, checkpoints, export, restarts, the run's own imports, health monitoring."""

from __future__ import annotations

import importlib
import math
import os
import sys
from dataclasses import dataclass, field
from allsync.config.errors import ConfigError


@dataclass
class RunSection:
    out_dir: str = "runs/dapo-tiny"
    steps: int = 100  # the run ends here; results reproduce for a seed whatever the machine's speed
    time_limit_minutes: float | None = None  # a guard only: stops early (and says so) on a slow machine
    eval_every: int = 10
    eval_samples: int = 1
    eval_top_p: float = 1.0  # nucleus sampling for sampled evaluation (eval_samples > 1); training samples at top_p 1
    checkpoint_every: int = 10
    keep_checkpoints: int | None = None  # keep only the newest N checkpoints (None: keep all)
    seed: int = 0
    max_consecutive_nan: int = 3
    max_restarts: int = (
        0  # a lost worker (dead, or past step_timeout) restarts the workers from the last good checkpoint, this often
    )
    step_timeout: float | None = None  # seconds a step may take before its workers count as lost (None: wait)
    export: str = "peft"  # the trained adapter at the end: peft (vLLM serves it) | merged (full bf16 checkpoint)
    # modules imported before the rest of the config is read, in every process of the run: a task, producer, policy
    # loss or advantage estimator of your own registers itself there (README, "To add"), e.g. [my_project.tasks]
    imports: list[str] = field(default_factory=list)
    # the launch mode by name (allsync/launch/group.py): spmd | local | ray, or one a module of run.imports registers.
    # None: spmd under torchrun / accelerate launch, local with --no-ray or one worker, ray otherwise
    launch: str | None = None

    def check(self, fail) -> None:
        if not 0 < self.eval_top_p <= 1:
            fail(f"run.eval_top_p = {self.eval_top_p}: must be in (0, 1]")
        if self.eval_samples < 1:
            fail(
                f"run.eval_samples = {self.eval_samples}: must be >= 1 (1 = greedy, k = avg@k at the rollout temperature)"
            )
        if self.max_consecutive_nan < 1:
            fail(f"run.max_consecutive_nan = {self.max_consecutive_nan}: must be >= 1")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            fail(f"run.keep_checkpoints = {self.keep_checkpoints}: must be >= 1 (or null to keep all)")
        if self.time_limit_minutes is not None and self.time_limit_minutes <= 0:
            fail(f"run.time_limit_minutes = {self.time_limit_minutes}: must be > 0 (or null for none)")
        if self.export not in ("peft", "merged"):
            fail(f"run.export = {self.export!r}: use peft or merged")
        if self.max_restarts < 0:
            fail(f"run.max_restarts = {self.max_restarts}: must be >= 0")
        if self.step_timeout is not None and not self.step_timeout > 0:
            fail(f"run.step_timeout = {self.step_timeout}: must be > 0 seconds (or null: wait)")
        if self.steps < 1 or self.checkpoint_every < 1 or self.eval_every < 1:
            fail("run.steps, run.checkpoint_every and run.eval_every must be >= 1")


@dataclass
class HealthSection:
    """Finding the faulty worker (allsync/health/detector.py) and fault drills (allsync/health/faults.py)."""

    detector: str = (
        "similarity"  # similarity (Minder-style: workers compared with each other) | threshold (the baseline) | off
    )
    window: int = 2  # steps averaged per comparison
    continuity: int = 2  # consecutive flagged steps before an alarm
    min_distance: float = (
        2.0  # a worker's distance to the others, in units of the metric's cross-worker noise (its p90)
    )
    min_z: float = 1.5  # its distance's z-score across workers
    faults: list[dict] = field(default_factory=list)  # drills: {kind, rank, step, steps, factor, seconds, mb}

    def check(self, fail) -> None:
        if self.detector not in ("similarity", "threshold", "off"):
            fail(
                f"health.detector = {self.detector!r}: use similarity (workers compared with each other), threshold (the baseline) or off"
            )
        for key in ("window", "continuity"):
            if getattr(self, key) < 1:
                fail(f"health.{key} = {getattr(self, key)}: must be >= 1")
        for key in ("min_distance", "min_z"):
            if not math.isfinite(getattr(self, key)) or getattr(self, key) < 0:
                fail(f"health.{key} = {getattr(self, key)}: must be a finite number >= 0")
        if self.detector != "similarity":
            for key in ("window", "continuity", "min_distance", "min_z"):
                if getattr(self, key) != getattr(HealthSection(), key):
                    fail(
                        f"health.{key} = {getattr(self, key)} with health.detector {self.detector}: only the similarity detector reads it"
                    )


def import_extensions(modules, source: str = "<config>") -> None:
    """Import run.imports' modules (each registers its task, producer, policy loss or estimator on import), from
    the Python path or the directory the run is started in (as `python -m` would; `python recipes/dapo.py` puts only
    recipes/ on the path); a name that is not such a module is a ConfigError naming it."""
    if not modules:
        return
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise ConfigError(f"{source}: run.imports must be a list of module names, got {modules!r}")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    for module in modules:
        if not module.strip() or module.startswith("."):
            raise ConfigError(
                f"{source}: run.imports: {module!r} is not an absolute module name (write e.g. my_project.tasks; "
                "a relative name has no package to be relative to)"
            )
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(f"{source}: run.imports: cannot import {module!r} ({exc})") from exc


def run_imports(data) -> list[str] | None:
    """run.imports of a config's raw mapping (None when absent; a malformed section is refused by _build)."""
    run = data.get("run") if isinstance(data, dict) else None
    return run.get("imports") if isinstance(run, dict) else None
