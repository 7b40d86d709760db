"""Training checkpoints without pickle: tensors in safetensors, everything else in JSON.

    checkpoints/step-000100/
        adapter/                  PEFT adapter (adapter_config.json + adapter_model.safetensors)
        trainer.safetensors       AdamW moments and step counts, the value head (PPO)   (rank 0)
        trainer.json              optimizer param groups, adapter version               (rank 0)
        rank{r}.safetensors       torch's RNG state                                      (each rank)
        rank{r}.json              data position, Python/NumPy RNG states, T-PPO pools    (each rank)
        controller.json           step, base accuracies
    checkpoints/latest            the newest step directory's name

Nothing here runs code found in a checkpoint directory (no pickle, no `torch.load`), and renaming a
Python class never breaks a resume: the on-disk layout is plain keys. A missing or malformed file is a
`CheckpointStateError` naming it.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

OPTIMIZER_PREFIX = "optimizer.state."
VALUE_HEAD_PREFIX = "value_head."


class CheckpointStateError(ValueError):
    """A checkpoint file is missing or does not hold what this allsync writes; the message names it."""


# ------------------------------------------------------------------------------------------ optimizer
def optimizer_state_to_files(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """torch optimizer state_dict -> (tensors, JSON-able meta).

    tensors["optimizer.state.{param}.{name}"] holds every tensor entry of state[param]; meta keeps the
    param groups and the non-tensor state entries, so `optimizer_state_from_files` rebuilds it exactly."""
    tensors, scalars = {}, {}
    for param, entries in state_dict["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{OPTIMIZER_PREFIX}{param}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(param), {})[name] = value
    return tensors, {"param_groups": state_dict["param_groups"], "scalars": scalars}


def optimizer_state_from_files(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """Inverse of `optimizer_state_to_files` (tuple-valued group options such as betas come back as tuples)."""
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith(OPTIMIZER_PREFIX):
            param, name = key[len(OPTIMIZER_PREFIX) :].split(".", 1)
            state.setdefault(int(param), {})[name] = value
    for param, entries in meta.get("scalars", {}).items():
        state.setdefault(int(param), {}).update(entries)
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


# ------------------------------------------------------------------------------------------ RNG
def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """The process's torch (CPU, and the current GPU's when CUDA is initialized), Python and NumPy RNG states
    as (tensors, JSON-able)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {"torch_rng": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # sampling on a GPU draws from its generator
        tensors["cuda_rng"] = torch.cuda.get_rng_state()
    return tensors, {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["torch_rng"])
    if "cuda_rng" in tensors:
        torch.cuda.set_rng_state(tensors["cuda_rng"])
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


# ------------------------------------------------------------------------------------------ files
def write_state(directory: Path, name: str, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """`name`.safetensors and `name`.json in `directory` (the caller makes the directory atomic)."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / f"{name}.safetensors"))
    (directory / f"{name}.json").write_text(json.dumps(meta))


def read_state(directory: Path, name: str) -> tuple[dict[str, torch.Tensor], dict]:
    """What `write_state` wrote; an error naming the file when it is missing or unreadable."""
    directory = Path(directory)
    if (directory / f"{name}.pt").exists() and not (directory / f"{name}.json").exists():
        raise CheckpointStateError(
            f"{directory / (name + '.pt')}: a pickled checkpoint from an older allsync; it is not loaded, because "
            "unpickling runs code from the checkpoint directory. Start a new run (or export its adapter/ with allsync export)"
        )  # fmt: skip
    paths = directory / f"{name}.safetensors", directory / f"{name}.json"
    for path in paths:
        if not path.exists():
            raise CheckpointStateError(f"{path}: missing from the checkpoint")
    try:
        tensors = load_file(str(paths[0]))
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise CheckpointStateError(f"{paths[0]}: not a readable safetensors file ({exc})") from exc
    try:
        meta = json.loads(paths[1].read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointStateError(f"{paths[1]}: invalid JSON ({exc})") from exc
    return tensors, meta


# ------------------------------------------------------------------------------------------ pruning
def step_directories(checkpoints: Path) -> list[Path]:
    """checkpoints/step-NNNNNN directories, oldest first."""
    if not checkpoints.is_dir():
        return []
    return sorted(p for p in checkpoints.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit())


def prune_checkpoints(checkpoints: Path, keep: int | None) -> list[Path]:
    """Delete all but the newest `keep` step directories (None keeps all); returns what was deleted."""
    if keep is None:
        return []
    doomed = step_directories(checkpoints)[:-keep]
    for path in doomed:
        shutil.rmtree(path)
    return doomed
