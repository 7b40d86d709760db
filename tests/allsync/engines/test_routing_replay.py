"""Issue 28: the torch engine records the experts each token went to; the trainer measures how often its own choice
differs (routing_mismatch) and with algorithm.routing_replay (R3) uses the engine's experts."""

import pytest
import torch

from allsync.config import ConfigError, parse_config
from allsync.engines.torch_engine import Sampling
from allsync.update.sequences import build_sequences
from allsync.metrics import aggregate
from allsync.tasks import Problem
from allsync.run.worker import RLWorker
from moe_lora.routing import moe_layers, recording, replaying

PROBLEMS = [Problem(f"what is {a}+{b}?", str(a + b)) for a in range(10) for b in range(10)]


def config(base, engine_formats=None, replay=False, **extra):
    return parse_config(
        {
            "model": {"base": str(base), "quant": {"routed_experts": "nf4"}},
            "lora": {"rank": 8, "alpha": 16},
            "rollout": {"prompts_per_step": 4, "group_size": 2, "max_new_tokens": 6, "engine_formats": engine_formats},
            "algorithm": {"dynamic_sampling": False, "routing_replay": replay},
            "optim": {"lr": 1e-2},
            "parallel": {"workers_per_node": 1},
            **extra,
        }
    )


def trainer_routing(model, batch, replay: bool):
    """The experts the trainer's MoE layers use on `batch` (recorded outside the replay): [B, L, layers, k]."""
    with replaying(model, replay) as state, torch.no_grad():
        model.routing_replay = state
        try:
            with recording(model) as record:
                state.set(*batch.flat_routing())
                model.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
        finally:
            del model.routing_replay
    return record.call(0).view(*batch.input_ids.shape, *record.call(0).shape[1:]), state.take_counts()


def test_the_engine_records_every_fed_tokens_experts_as_the_trainer_routes_them(tiny_bf16):
    """Same model for both (no engine_formats): the recorded experts of every prompt and response token fed to the
    model are the ones the trainer's full forward picks (as sets), and the last response token has none."""
    worker = RLWorker(config(tiny_bf16), PROBLEMS)
    prompts = [worker.encode_prompt(p) for p in PROBLEMS[:3]]
    rollout = worker.engine.generate(prompts, 2, Sampling(max_new_tokens=6))
    layers, k = len(moe_layers(worker.model)), worker.model.config.num_experts_per_tok
    for prompt, response, experts in zip(rollout.prompt_ids, rollout.response_ids, rollout.routing):
        assert experts.shape == (len(prompt) + len(response) - 1, layers, k) and experts.dtype == torch.uint8
    batch = build_sequences(rollout.prompt_ids, rollout.response_ids, worker.learner.pad_id, rollout.routing)
    own, (mismatched, counted) = trainer_routing(worker.model, batch, replay=False)
    has = batch.routing_has
    same = own.sort(-1).values == batch.routing.long().sort(-1).values
    assert counted > 0 and bool(same.all(-1).all(-1)[has].all()) and mismatched == 0


def test_replay_makes_the_trainer_use_the_engines_experts_and_shrinks_the_logprob_gap(tiny_bf16):
    """Engine bf16 experts, trainer NF4: some (token, layer) pairs route differently; under replay the trainer's
    layers use exactly the recorded experts, and its logprobs come closer to the engine's."""
    worker = RLWorker(config(tiny_bf16, {"routed_experts": "bf16"}), PROBLEMS)
    prompts = [worker.encode_prompt(p) for p in PROBLEMS[:16]]
    rollout = worker.engine.generate(prompts, 2, Sampling(max_new_tokens=6))
    batch = build_sequences(rollout.prompt_ids, rollout.response_ids, worker.learner.pad_id, rollout.routing)
    own, (mismatched, counted) = trainer_routing(worker.model, batch, replay=False)
    replayed, (mismatched_again, _) = trainer_routing(worker.model, batch, replay=True)
    has = batch.routing_has
    assert mismatched > 0  # the formats differ enough to flip some experts
    assert mismatched_again == mismatched  # the metric compares the trainer's own choice either way
    assert torch.equal(replayed[has], batch.routing.long()[has])
    assert not torch.equal(own[has].sort(-1).values, batch.routing.long()[has].sort(-1).values)


def gaps(worker, steps=3):
    return [aggregate([worker.step(step)]) for step in range(1, steps + 1)]


def test_routing_mismatch_is_logged_every_step_and_replay_lowers_the_logprob_gap(tiny_bf16):
    torch.manual_seed(0)
    plain = gaps(RLWorker(config(tiny_bf16, {"routed_experts": "bf16"}), PROBLEMS))
    torch.manual_seed(0)
    replayed = gaps(RLWorker(config(tiny_bf16, {"routed_experts": "bf16"}, replay=True), PROBLEMS))
    matched = gaps(RLWorker(config(tiny_bf16), PROBLEMS))
    # logged every step; a step of 8 short samples may route every (token, layer) pair alike, the steps together not
    assert all(0 <= m["routing_mismatch"] < 0.5 for m in plain + replayed)
    assert sum(m["routing_mismatch"] for m in plain) > 0 and sum(m["routing_mismatch"] for m in replayed) > 0
    assert all(m["routing_mismatch"] == 0 for m in matched)
    # the first step samples the same tokens (same seed, same engine): only the trainer's routing differs
    assert replayed[0]["logprob_gap"] < plain[0]["logprob_gap"]


@pytest.mark.parametrize("optim, algorithm", [({"minibatches": 2}, {}), ({}, {"kl_coef": 0.5})])
def test_a_matched_engine_reads_no_mismatch_with_minibatches_and_a_reference_pass(tiny_bf16, optim, algorithm):
    """The trainer is its own engine (same weights, same kernels): the true mismatch is 0. Counted on every forward of
    the step it read 15-25% at optim.minibatches 2 (the second minibatch runs after an optimizer step) and 28-38% at
    kl_coef 0.5 (the reference pass with adapters off); counted on the first policy pass only it reads 0, over each
    (trained token, MoE layer) pair once."""
    c = config(tiny_bf16)
    c.optim.lr = 5e-2  # a large first step: a second minibatch after it routes differently
    c.optim.minibatches = optim.get("minibatches", 1)
    c.algorithm.kl_coef = algorithm.get("kl_coef", 0.0)
    torch.manual_seed(0)
    worker = RLWorker(c, PROBLEMS)
    per_step = [worker.step(step) for step in (1, 2, 3)]
    layers = len(moe_layers(worker.model))
    for m in per_step:
        assert m["routing_mismatched"] == 0
        # every trained token but each response's last (never fed to the engine: no recorded route), once per layer
        assert m["routing_counted"] == (m["trained_tokens"] - m["trained_samples"]) * layers


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"rollout": {"engine": "vllm"}}, r"algorithm.routing_replay with rollout.engine vllm"),
        ({"producer": {"kind": "multiconv", "memory_tokens": 8}}, r"routing_replay with producer.kind multiconv"),
    ],
)
def test_routing_replay_is_refused_where_no_experts_reach_the_trainer(tiny_bf16, changes, message):
    raw = {
        "model": {"base": str(tiny_bf16)},
        "rollout": {"prompts_per_step": 4, "group_size": 2, **changes.get("rollout", {})},
        "algorithm": {"routing_replay": True},
        **({"producer": changes["producer"], "task": {"name": "memory_recall"}} if "producer" in changes else {}),
    }
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)
