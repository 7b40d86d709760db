"""Checkpoint state files: no pickle anywhere, exact round trips, old pickled files refused, pruning."""

import json
import random

import numpy as np
import pytest
import torch

from allsync.run.checkpoint import (
    CheckpointStateError,
    optimizer_state_from_files,
    optimizer_state_to_files,
    prune_checkpoints,
    read_state,
    rng_state,
    set_rng_state,
    write_state,
)


def stepped_adamw() -> torch.optim.AdamW:
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(4))]
    opt = torch.optim.AdamW(
        [{"params": params[:1], "base_lr": 1e-3}, {"params": params[1:], "base_lr": 5e-4}],
        lr=1e-3,
        betas=(0.9, 0.99),
        weight_decay=0.1,
    )
    for _ in range(3):
        sum(p.square().sum() for p in params).backward()
        opt.step()
    return opt


def test_adamw_state_round_trips_through_safetensors_and_json(tmp_path):
    opt = stepped_adamw()
    tensors, meta = optimizer_state_to_files(opt.state_dict())
    write_state(tmp_path, "trainer", tensors, {"optimizer": meta})
    loaded_tensors, loaded = read_state(tmp_path, "trainer")
    restored = optimizer_state_from_files(loaded_tensors, loaded["optimizer"])
    original = opt.state_dict()
    assert restored["param_groups"] == original["param_groups"]  # betas come back as a tuple
    for param, entries in original["state"].items():
        for name, value in entries.items():
            assert torch.equal(restored["state"][param][name], value), (param, name)
    fresh = stepped_adamw()
    fresh.load_state_dict(restored)  # torch accepts it
    assert int(fresh.state_dict()["state"][0]["step"]) == 3


def test_rng_states_round_trip(tmp_path):
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    tensors, meta = rng_state()
    write_state(tmp_path, "rank0", tensors, {"rng": meta})
    expected = (torch.rand(3), random.random(), np.random.rand())
    t, m = read_state(tmp_path, "rank0")
    set_rng_state(t, m["rng"])
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_no_file_of_a_checkpoint_is_a_pickle(tmp_path):
    write_state(tmp_path, "trainer", *optimizer_state_to_files(stepped_adamw().state_dict()))
    for path in tmp_path.iterdir():
        head = path.read_bytes()[:2]
        assert head != b"\x80\x02" and not path.read_bytes().startswith(b"PK"), path  # pickle protocol 2+, torch's zip
        if path.suffix == ".json":
            json.loads(path.read_text())


def test_an_old_pickled_checkpoint_is_refused_by_name(tmp_path):
    torch.save({"optimizer": {}}, tmp_path / "trainer.pt")
    with pytest.raises(
        CheckpointStateError, match=r"trainer\.pt: a pickled checkpoint from an older allsync; it is not loaded"
    ):
        read_state(tmp_path, "trainer")


def test_missing_and_broken_state_files_are_named(tmp_path):
    with pytest.raises(CheckpointStateError, match=r"rank1\.safetensors: missing from the checkpoint"):
        read_state(tmp_path, "rank1")
    write_state(tmp_path, "rank1", {"x": torch.zeros(1)}, {})
    (tmp_path / "rank1.json").write_text("{not json")
    with pytest.raises(CheckpointStateError, match=r"rank1\.json: invalid JSON"):
        read_state(tmp_path, "rank1")


def test_prune_keeps_the_newest_checkpoints(tmp_path):
    for step in (3, 12, 6, 9):
        (tmp_path / f"step-{step:06d}").mkdir()
    (tmp_path / "latest").write_text("step-000012")
    deleted = prune_checkpoints(tmp_path, keep=2)
    assert [p.name for p in deleted] == ["step-000003", "step-000006"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000009", "step-000012"]
    assert prune_checkpoints(tmp_path, keep=None) == []


def test_a_rank_whose_probe_the_controller_cannot_see_is_named(tmp_path):
    """Multi-node runs write checkpoint parts into the controller's run.out_dir from every node: each rank writes a
    probe there first, and a rank whose file the controller does not see (its node has another filesystem at that
    path: here, its file went to another directory) is named with its host."""
    from allsync.run.checkpoint import unseen_probes, write_probe

    seen, elsewhere = tmp_path / "controller-view", tmp_path / "node-1-view"
    hosts = [write_probe(seen, 0), write_probe(elsewhere, 1), write_probe(seen, 2)]
    assert unseen_probes(seen, hosts) == [f"rank 1 ({hosts[1]})"]
    assert unseen_probes(elsewhere, hosts) == [f"rank 0 ({hosts[0]})", f"rank 2 ({hosts[2]})"]
    write_probe(seen, 1)
    assert unseen_probes(seen, hosts) == []
