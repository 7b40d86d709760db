"""Checkpoint manifests: sizes and sha256 of every file, written last; a truncated, corrupted or cut-short
checkpoint is refused naming the file, and resume falls back to the newest one that checks out."""

import hashlib
import importlib.util
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from allsync.run.checkpoint import (
    MANIFEST,
    CheckpointStateError,
    latest_good_checkpoint,
    verify_checkpoint,
    write_manifest,
)

ROOT = Path(__file__).resolve().parents[2]


def fake_checkpoint(directory: Path, seed: int = 0) -> Path:
    """A step directory as save_checkpoint lays it out: a real safetensors file, JSON, a nested adapter/."""
    directory.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    save_file(
        {"a": torch.randn(64, 32, generator=generator), "b": torch.arange(10)}, str(directory / "rank0.safetensors")
    )
    (directory / "rank0.json").write_text(json.dumps({"position": 7 + seed, "python": [3, list(range(20))]}))
    (directory / "adapter").mkdir()
    (directory / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (directory / "controller.json").write_text(json.dumps({"step": seed}))
    write_manifest(directory)
    return directory


def truncate(path: Path, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def refusal(directory: Path) -> str:
    with pytest.raises(CheckpointStateError) as info:
        verify_checkpoint(directory)
    return str(info.value)


# ------------------------------------------------------------------------------------------ write_manifest
def test_manifest_lists_every_file_with_its_size_and_sha256_but_not_itself(tmp_path):
    step = fake_checkpoint(tmp_path / "step-000001")
    manifest = json.loads((step / MANIFEST).read_text())
    assert manifest["version"] == 1 and manifest["format"] == "allsync-checkpoint-manifest"
    assert sorted(manifest["files"]) == [
        "adapter/adapter_config.json",
        "controller.json",
        "rank0.json",
        "rank0.safetensors",
    ]
    for name, entry in manifest["files"].items():
        data = (step / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert stat.S_IMODE(os.stat(step / MANIFEST).st_mode) == 0o644  # atomic_write_text's mode, not mkstemp's 0600
    assert [p.name for p in step.iterdir() if p.name.startswith(".")] == []  # no temporary file left behind
    verify_checkpoint(step)  # the round trip passes
    assert write_manifest(step) == manifest  # written again over itself: still not listed


def test_manifest_hashes_a_file_larger_than_one_chunk(tmp_path):
    (tmp_path / "big.bin").write_bytes(os.urandom((1 << 20) * 2 + 123))
    write_manifest(tmp_path)
    verify_checkpoint(tmp_path)
    flip_byte(tmp_path / "big.bin", (1 << 20) + 5)  # in the second chunk
    assert "big.bin: sha256 differs from the manifest: corrupted" in refusal(tmp_path)


# ------------------------------------------------------------------------------------------ verify_checkpoint
def test_a_truncated_file_is_refused_by_name(tmp_path):
    step = fake_checkpoint(tmp_path / "step-000001")
    size = (step / "rank0.safetensors").stat().st_size
    truncate(step / "rank0.safetensors", size - 100)
    message = refusal(step)
    assert message == f"{step / 'rank0.safetensors'}: {size - 100} bytes, the manifest says {size}: truncated"


def test_a_flipped_byte_of_the_same_size_is_refused_by_name(tmp_path):
    step = fake_checkpoint(tmp_path / "step-000001")
    flip_byte(step / "adapter" / "adapter_config.json", 3)
    assert refusal(step) == f"{step / 'adapter' / 'adapter_config.json'}: sha256 differs from the manifest: corrupted"


def test_a_checkpoint_without_a_manifest_is_refused(tmp_path):
    step = fake_checkpoint(tmp_path / "step-000001")
    (step / MANIFEST).unlink()
    message = refusal(step)
    assert (
        message.startswith(str(step))
        and "no manifest.json: the checkpoint was cut short or written by an older allsync" in message
    )


def test_an_unreadable_manifest_is_refused(tmp_path):
    step = fake_checkpoint(tmp_path / "step-000001")
    text = (step / MANIFEST).read_text()
    (step / MANIFEST).write_text(text[: len(text) // 2])
    assert refusal(step).startswith(f"{step / MANIFEST}: unreadable manifest (")
    (step / MANIFEST).write_text(
        json.dumps(
            {
                "format": "allsync-checkpoint-manifest",
                "version": 1,
                "files": {"../outside": {"bytes": 1, "sha256": "0"}},
            }
        )
    )
    assert refusal(step).startswith(f"{step / MANIFEST}: unreadable manifest (")


def test_a_listed_file_that_is_gone_is_refused_by_name(tmp_path):
    step = fake_checkpoint(tmp_path / "step-000001")
    (step / "rank0.json").unlink()
    assert refusal(step) == f"{step / 'rank0.json'}: listed in manifest.json but missing"


def test_a_file_the_manifest_does_not_list_is_ignored(tmp_path):
    step = fake_checkpoint(tmp_path / "step-000001")
    (step / "notes.txt").write_text("added by hand")
    verify_checkpoint(step)


# ------------------------------------------------------------------------------------------ latest_good_checkpoint
def test_resume_falls_back_past_a_truncated_and_a_corrupted_checkpoint(tmp_path):
    good = fake_checkpoint(tmp_path / "step-000002", seed=2)
    cut = fake_checkpoint(tmp_path / "step-000004", seed=4)
    flipped = fake_checkpoint(tmp_path / "step-000006", seed=6)
    (tmp_path / "latest").write_text("step-000006")  # the pointer names the corrupted one: not trusted
    truncate(cut / "rank0.safetensors", 40)
    flip_byte(flipped / "rank0.json", 1)
    warnings = []
    assert latest_good_checkpoint(tmp_path, warn=warnings.append) == good
    assert len(warnings) == 2
    assert warnings[0].startswith(f"warning: {flipped / 'rank0.json'}: sha256 differs from the manifest: corrupted")
    assert warnings[1].startswith(f"warning: {cut / 'rank0.safetensors'}: 40 bytes, the manifest says ")
    assert "truncated" in warnings[1]
    assert all(w.endswith("; falling back to the previous checkpoint") for w in warnings)


def test_the_newest_good_checkpoint_wins_without_warnings(tmp_path):
    fake_checkpoint(tmp_path / "step-000002", seed=2)
    newest = fake_checkpoint(tmp_path / "step-000004", seed=4)
    warnings = []
    assert latest_good_checkpoint(tmp_path, warn=warnings.append) == newest
    assert warnings == []


def test_no_checkpoint_is_none_and_all_bad_is_an_error_naming_each(tmp_path):
    assert latest_good_checkpoint(tmp_path / "missing") is None
    assert latest_good_checkpoint(tmp_path) is None
    first = fake_checkpoint(tmp_path / "step-000002", seed=2)
    second = fake_checkpoint(tmp_path / "step-000004", seed=4)
    (first / MANIFEST).unlink()
    truncate(second / "controller.json", 2)
    warnings = []
    with pytest.raises(CheckpointStateError) as info:
        latest_good_checkpoint(tmp_path, warn=warnings.append)
    message = str(info.value)
    assert f"{second / 'controller.json'}: 2 bytes" in message and f"{first}: no manifest.json" in message
    assert warnings == []  # nothing to fall back to: the error says it all


# ------------------------------------------------------------------------------------------ recipes/dapo.py
def dapo_recipe():
    spec = importlib.util.spec_from_file_location("dapo_recipe_under_test", ROOT / "recipes" / "dapo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeGroup:
    """The controller of a WorkerGroup whose one worker writes a rank file for save_state."""

    is_controller = True

    def call(self, method, directory):
        assert method == "save_state"
        save_file({"torch_rng": torch.arange(5, dtype=torch.uint8)}, str(Path(directory) / "rank0.safetensors"))
        (Path(directory) / "rank0.json").write_text("{}")


def test_save_checkpoint_writes_the_manifest_over_controller_json_and_resume_checks_it(tmp_path, capsys):
    dapo = dapo_recipe()
    first = dapo.save_checkpoint(FakeGroup(), tmp_path, 3, {"base_accuracy": 0.5})
    second = dapo.save_checkpoint(FakeGroup(), tmp_path, 6, {"base_accuracy": 0.5})
    files = json.loads((second / MANIFEST).read_text())["files"]
    assert sorted(files) == ["controller.json", "rank0.json", "rank0.safetensors"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step-000006"  # still written, for people
    assert dapo.latest_checkpoint(tmp_path) == second
    (second / "controller.json").write_text(json.dumps({"step": 9, "base_accuracy": 0.5}))  # same size, other bytes
    assert dapo.latest_checkpoint(tmp_path) == first
    assert f"warning: {second / 'controller.json'}: sha256 differs" in capsys.readouterr().out
