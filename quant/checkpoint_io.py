"""Reading and writing HF sharded safetensors checkpoints (`model.safetensors.index.json` + shards).

Writers build the whole output in a temporary sibling directory and rename it into place at the end,
so a failure never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint on disk does not match what its config or index says; the message names file and key."""


def shard_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def split_into_shards(tensors: dict[str, torch.Tensor], num_shards: int) -> list[dict[str, torch.Tensor]]:
    """Greedy split in key order: a new shard starts once the current one reaches total / num_shards bytes."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    target = total / num_shards
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        if size >= target and len(shards) < num_shards:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += t.numel() * t.element_size()
    return shards


def write_shards(directory: Path, shards: list[dict[str, torch.Tensor]]) -> dict:
    """Write shards and their index into `directory` (which the caller makes atomic); returns the index."""
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        name = shard_name(i, len(shards))
        save_file({k: v.contiguous() for k, v in shard.items()}, str(directory / name), metadata={"format": "pt"})
        for key, t in shard.items():
            weight_map[key] = name
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return index


DIR_MODE, FILE_MODE = 0o755, 0o644  # rwxr-xr-x: others may enter and list; rw-r--r--: others may read


def share_tree(root: Path) -> None:
    """Make `root` and everything under it readable by every user: directories DIR_MODE, files FILE_MODE.

    A directory needs its x bit to be entered, so a checkpoint whose `adapter/` were 0644 could not be
    read by a non-root user, not even its owner. Symbolic links are left alone (chmod would follow them).
    """
    os.chmod(root, DIR_MODE)
    for directory, subdirs, files in os.walk(root):
        for name in subdirs:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                os.chmod(path, DIR_MODE)
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                os.chmod(path, FILE_MODE)


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to `out`; on success rename it to `out`, on failure delete it.

    An existing non-empty `out` is an error unless overwrite (then it is replaced only after success).
    """
    out = Path(out).resolve()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; choose another output directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    share_tree(tmp)  # mkdtemp makes it private; a checkpoint is meant to be shared
    if out.exists():
        shutil.rmtree(out)
    os.rename(tmp, out)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, FILE_MODE)  # mkstemp makes it 0600
    os.replace(tmp, path)


def read_weight_map(checkpoint: str | os.PathLike) -> dict[str, str]:
    """key -> shard file name, from the index (or from the single `model.safetensors`)."""
    checkpoint = Path(checkpoint)
    index_path = checkpoint / INDEX_NAME
    if index_path.exists():
        try:
            index = json.loads(index_path.read_text())
            return dict(index["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_path}: not a safetensors index with a 'weight_map' ({exc})") from exc
    single = checkpoint / SINGLE_NAME
    if single.exists():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return {k: SINGLE_NAME for k in f.keys()}
    raise CheckpointError(f"{checkpoint}: neither {INDEX_NAME} nor {SINGLE_NAME} found")


def checkpoint_bytes(checkpoint: str | os.PathLike) -> int:
    """Bytes of the checkpoint's safetensors files (the weights as stored, headers included)."""
    checkpoint = Path(checkpoint)
    return sum((checkpoint / name).stat().st_size for name in set(read_weight_map(checkpoint).values()))


def read_config(checkpoint: str | os.PathLike) -> dict:
    path = Path(checkpoint) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path}: missing (a DeepSeek-V3 checkpoint needs its config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from exc
