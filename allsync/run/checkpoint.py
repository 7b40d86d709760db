"""Training checkpoints without pickle: tensors in safetensors, everything else in JSON.

    checkpoints/step-000100/
        adapter/                  PEFT adapter (adapter_config.json + adapter_model.safetensors)
        trainer.safetensors       AdamW moments and step counts, the critic (PPO)       (rank 0)
        trainer.json              optimizer param groups, adapter version               (rank 0)
        rank{r}.safetensors       torch's RNG state                                      (each rank)
        rank{r}.json              data position, Python/NumPy RNG states, T-PPO pools    (each rank)
        controller.json           step, base accuracies
        manifest.json             every other file's size and sha256, written LAST      (rank 0)
    checkpoints/latest            the newest step directory's name (for people; resume does not trust it)

Nothing here runs code found in a checkpoint directory (no pickle, no `torch.load`), and renaming a
Python class never breaks a resume: the on-disk layout is plain keys. A missing or malformed file is a
`CheckpointStateError` naming it. Since manifest.json is written after everything else, a directory
without one was cut short; resume takes the newest step directory whose files all match their manifest
(`latest_good_checkpoint`) and says which file made it skip a newer one.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from quant.checkpoint_io import atomic_write_text

OPTIMIZER_PREFIX = "optimizer.state."
CRITIC_PREFIX = "critic."  # the critic's adapter and value head (allsync/update/critic.py)
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "allsync-checkpoint-manifest"
MANIFEST_VERSION = 1
HASH_CHUNK = 1 << 20  # files are hashed 1 MiB at a time, never read whole


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
        )
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
    return sorted(
        p for p in checkpoints.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()
    )


def earlier_run_files(out_dir: Path) -> list[str]:
    """What an earlier run left in `out_dir` (its metrics log, its checkpoints): a fresh run there would
    overwrite the log and, with run.keep_checkpoints, prune its own new checkpoints first (the old ones have
    higher step numbers)."""
    found = ["metrics.jsonl"] if (out_dir / "metrics.jsonl").exists() else []
    return found + [f"checkpoints/{p.name}" for p in step_directories(out_dir / "checkpoints")]


def write_probe(directory: Path, rank: int) -> str:
    """Rank `rank`'s probe file in `directory` (made if missing); returns this host's name."""
    import socket

    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank{rank}").write_text(socket.gethostname())
    return socket.gethostname()


def unseen_probes(directory: Path, hosts: list[str]) -> list[str]:
    """`rank R (host H)` for each rank whose probe file (written on its own node, see write_probe) is not in
    `directory` as the controller sees it: that node writes checkpoint parts where the controller cannot read them."""
    return [f"rank {rank} ({host})" for rank, host in enumerate(hosts) if not (directory / f"rank{rank}").is_file()]


def prune_checkpoints(checkpoints: Path, keep: int | None) -> list[Path]:
    """Delete all but the newest `keep` step directories (None keeps all); returns what was deleted."""
    if keep is None:
        return []
    doomed = step_directories(checkpoints)[:-keep]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


# ------------------------------------------------------------------------------------------ manifest
def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path) -> dict:
    """manifest.json in `directory`: {relative posix path: {"bytes", "sha256"}} for every file under it (the
    manifest excepted), written atomically. Call it last: a checkpoint without it is incomplete."""
    directory = Path(directory)
    files = {
        path.relative_to(directory).as_posix(): {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.relative_to(directory).as_posix() != MANIFEST
    }
    manifest = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "files": files}
    atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def read_manifest(directory: Path) -> dict[str, dict]:
    """The manifest's files entry; an error naming manifest.json when it is missing, not JSON, of another
    format or version, or lists a path outside the directory or an entry without an int size and a hash."""
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointStateError(
            f"{directory}: no {MANIFEST}: the checkpoint was cut short or written by an older allsync"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointStateError(f"{path}: unreadable manifest ({exc})") from exc
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != MANIFEST_FORMAT
        or manifest.get("version") != MANIFEST_VERSION
    ):
        raise CheckpointStateError(f"{path}: unreadable manifest (not a {MANIFEST_FORMAT} version {MANIFEST_VERSION})")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(valid_entry(name, entry) for name, entry in files.items()):
        raise CheckpointStateError(f"{path}: unreadable manifest (a bad 'files' entry)")
    return files


def valid_entry(name: str, entry) -> bool:
    """A relative path that stays inside the directory, an int size and a sha256 hex string."""
    parts = name.split("/")
    return (
        bool(name)
        and not name.startswith("/")
        and ".." not in parts
        and isinstance(entry, dict)
        and type(entry.get("bytes")) is int
        and isinstance(entry.get("sha256"), str)
    )


def verify_checkpoint(directory: Path) -> None:
    """Every file manifest.json lists is present with its size and sha256; the first that is not raises a
    `CheckpointStateError` naming it (missing, truncated, corrupted). Sizes are all checked before any
    file is hashed. Files the manifest does not list are ignored."""
    directory = Path(directory)
    files = read_manifest(directory)
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointStateError(f"{path}: listed in {MANIFEST} but missing")
        size = path.stat().st_size
        if size != entry["bytes"]:
            what = "truncated" if size < entry["bytes"] else "longer than it was written"
            raise CheckpointStateError(f"{path}: {size} bytes, the manifest says {entry['bytes']}: {what}")
    for name, entry in files.items():
        if file_sha256(directory / name) != entry["sha256"]:
            raise CheckpointStateError(f"{directory / name}: sha256 differs from the manifest: corrupted")


def latest_good_checkpoint(
    checkpoints: Path, warn: Callable[[str], object] = print, among: set[str] | None = None
) -> Path | None:
    """The newest checkpoints/step-NNNNNN that passes `verify_checkpoint`, warning (through `warn`) about
    each newer one refused. None when there is no step directory; a `CheckpointStateError` listing every
    refusal when none passes. The `latest` pointer is not consulted: it cannot vouch for the files.
    among: only these directory names (a restarted run's own checkpoints, not an older run's in the same place)."""
    refused = []
    for directory in reversed(step_directories(Path(checkpoints))):
        if among is not None and directory.name not in among:
            continue
        try:
            verify_checkpoint(directory)
        except CheckpointStateError as exc:
            refused.append(exc)
            continue
        for exc in refused:
            warn(f"warning: {exc}; falling back to the previous checkpoint")
        return directory
    if refused:
        raise CheckpointStateError(
            f"{checkpoints}: no checkpoint to resume from, every one is refused:\n  "
            + "\n  ".join(str(exc) for exc in refused)
        )
    return None
