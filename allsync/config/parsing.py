"""YAML -> RunConfig: unknown keys (with a did-you-mean), types, finite non-negative numbers, the task and producer
sections from their registries, then every section's own check and the checks across sections."""

from __future__ import annotations

import difflib
import math
import os
import types
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path

import yaml

from allsync.producers.registry import DEFAULT_PRODUCER, ProducerSettings, producer_classes
from allsync.tasks import TASKS, ArithmeticTask, TaskSettings
from allsync.config.checks import check_across_sections, check_this_machine
from allsync.config.errors import ConfigError
from allsync.config.run import import_extensions, run_imports
from allsync.config.run_config import RunConfig


def _type_ok(value, annotation) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(annotation)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if origin is dict:
        key, item = typing.get_args(annotation)
        return isinstance(value, dict) and all(_type_ok(k, key) and _type_ok(v, item) for k, v in value.items())
    return isinstance(value, annotation)


def _dataclass_of(annotation):
    """The dataclass inside `X` or `X | None`, else None."""
    candidates = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else (annotation,)
    )
    return next((c for c in candidates if is_dataclass(c)), None)


# keys of earlier versions -> where they are now
MOVED_KEYS = {
    "rollout.window": "producer: {kind: windows, window: N}",
    "rollout.memory_tokens": "producer: {kind: multiconv, memory_tokens: N}",
    "rollout.chunk_tokens": "producer: {kind: multiconv, chunk_tokens: N}",
    "algorithm.multiconv": "producer: {kind: multiconv, memory_tokens: N, credit, weighting}",
    "agent": "producer: {kind: agent, env, tools, max_turns, max_observation_tokens, step_timeout_s}",
}


# keys of earlier versions that no longer exist -> why, and what to write instead
REMOVED_KEYS = {
    "algorithm.value_coef": "the critic has its own AdamW param group, learning rate and gradient clip, and AdamW's "
    "step does not change when a loss is scaled by a constant, so the weight only moved where optim.grad_clip cut in "
    "(and 0 froze the critic); delete it: optim.value_lr sets how fast the critic learns",
}


def _build(cls, data: dict, where: str, source: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {where or 'the file'} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    for key in data:
        dotted = f"{where}.{key}" if where else str(key)
        if dotted in MOVED_KEYS:
            raise ConfigError(f"{source}: '{dotted}' has moved: write {MOVED_KEYS[dotted]} (allsync/producers/)")
        if dotted in REMOVED_KEYS:
            raise ConfigError(f"{source}: '{dotted}' was removed: {REMOVED_KEYS[dotted]}")
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = (
                f" (did you mean {where + '.' if where else ''}{close[0]}?)"
                if close
                else f" (known: {', '.join(names)})"
            )
            raise ConfigError(f"{source}: unknown key '{where + '.' if where else ''}{key}'{hint}")
    kwargs = {}
    for f in fields(cls):
        key = f"{where}.{f.name}" if where else f.name
        if f.name not in data:
            continue
        value, annotation = data[f.name], hints[f.name]
        sub = _dataclass_of(annotation)
        if annotation in (TaskSettings, ProducerSettings):
            kwargs[f.name] = _build_named_section(f.name, value, source)
        elif sub is not None and isinstance(value, dict):
            kwargs[f.name] = _build(sub, value, key, source)
        elif _type_ok(value, annotation):
            check_numbers(key, value, annotation, source)
            kwargs[f.name] = value
        else:
            raise ConfigError(f"{source}: '{key}' = {value!r} is not of type {annotation}")
    return cls(**kwargs)


def _holds_float(annotation) -> bool:
    """float, float | None, list[float] (a dict's values are free-form: reasoning-gym's dataset_args)."""
    if annotation is float:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, list):
        return any(_holds_float(a) for a in typing.get_args(annotation))
    return False


def check_numbers(key: str, value, annotation, source: str) -> None:
    """Every float setting is a finite number >= 0: none of the loop's rates, coefficients, clips, temperatures,
    timeouts or thresholds has a meaning below 0, and NaN or inf would pass every `x < bound` check after it
    (`optim.lr: .nan` writes NaN into the whole adapter at step 1). Sections check their own upper bounds."""
    if not _holds_float(annotation):
        return
    for number in value if isinstance(value, list) else [value]:
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            if not math.isfinite(number):
                raise ConfigError(f"{source}: {key} = {value!r}: must be a finite number")
            if number < 0:
                raise ConfigError(f"{source}: {key} = {value!r}: must be >= 0")


# section -> (the key naming the class, its registry, the default name)
NAMED_SECTIONS = {
    "task": ("name", lambda: TASKS, ArithmeticTask.name),
    "producer": ("kind", producer_classes, DEFAULT_PRODUCER),
}


def _build_named_section(section: str, data, source: str):
    """`task:` / `producer:`: the class its name key picks from the registry (allsync.tasks, allsync.producers),
    built from the section's other keys; a key only another class of the registry has is refused as unused."""
    name_key, registry, default = NAMED_SECTIONS[section]
    classes = registry()
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: {section} must be a mapping, got {type(data).__name__}")
    name = data.get(name_key, default)
    if name not in classes:
        raise ConfigError(f"{source}: {section}.{name_key} = {name!r}: use one of {', '.join(classes)}")
    own = {f.name for f in fields(classes[name])}
    for key in data:
        if key not in own and any(key in {f.name for f in fields(other)} for other in classes.values()):
            raise ConfigError(
                f"{source}: {section}.{key} is set but {section}.{name_key} is {name}, which does not use it"
            )
    return _build(classes[name], {k: v for k, v in data.items() if k != name_key}, section, source)


def parse_config(data: dict, source: str = "<config>") -> RunConfig:
    import_extensions(run_imports(data), source)
    config = _build(RunConfig, data or {}, "", source)
    validate(config, source)
    return config


def read_yaml(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: config file not found")
    try:
        return yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML ({exc})") from exc


def load_config(path: str | os.PathLike) -> RunConfig:
    return parse_config(read_yaml(path), str(path))


def load_config_for_planning(path: str | os.PathLike) -> tuple[RunConfig, ConfigError | None]:
    """The config built section by section, and what the checks across sections refuse in it, if anything, without
    raising it (not what this machine lacks: the plan is for the GPUs it is told): `allsync plan` plans configs the
    loop refuses (a layout it has not built yet) and says why. What is
    wrong in a section itself (an unknown key, a wrong type, a value out of range such as rollout.max_new_tokens 0)
    has no plan and raises, but for the parallel section, which the plan's --gpus / --expert-parallel may replace
    (the plan checks the sizes it uses)."""
    data = read_yaml(path)
    if not data:
        raise ConfigError(f"{path}: the config is empty: a plan of nothing but the defaults would plan no run of yours")
    import_extensions(run_imports(data), str(path))
    config = _build(RunConfig, data, "", str(path))

    def fail(msg: str):
        raise ConfigError(f"{path}: {msg}")

    for section in own_sections(config):
        if section is not config.parallel:
            section.check(fail)
    try:
        validate(config, str(path), this_machine=False)
    except ConfigError as exc:
        return config, exc
    return config, None


def own_sections(c: RunConfig) -> list:
    """The sections that check their own keys (`check(fail)`), in the order their refusals are named."""
    sections = (c.model, c.lora, c.rollout, c.algorithm, c.optim, c.parallel, c.task, c.reward, c.run, c.health)
    return [s for s in (*sections, c.producer) if s is not None]


def validate(c: RunConfig, source: str = "<config>", this_machine: bool = True) -> None:
    """Every section checks its own keys (its `check`), then `check_across_sections` the rules that tie sections
    together, then (with `this_machine`) what this machine must have to run it; each refusal names the key(s)
    involved. `allsync plan` leaves the last out: it plans for the GPUs it is told, not for the machine it runs on."""

    def fail(msg: str):
        raise ConfigError(f"{source}: {msg}")

    for section in own_sections(c):
        section.check(fail)
    check_across_sections(c, fail)
    if this_machine:
        check_this_machine(c, fail)
