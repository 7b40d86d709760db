"""Workers: two Ray workers with half a batch each make exactly the update one worker makes with all of it."""

import pytest
import torch

import allsync.update.optimizer as update_module
from allsync.config import parse_config
from allsync.metrics import aggregate
from allsync.launch.local import LocalGroup
from allsync.launch.ray_actors import RayGroup
from allsync.tasks import Problem
from allsync.episodes import Episode
from allsync.run.worker import RewardError, RLWorker

PROBLEMS = [Problem(f"what is {a}+{b}?", str(a + b)) for a in range(10) for b in range(10)]


def config(base, workers, lr=1e-2):
    return parse_config(
        {
            "model": {"base": str(base), "quant": {"routed_experts": "nf4"}},
            "lora": {"rank": 4, "alpha": 8},
            "run": {"export": "merged"},
            "rollout": {"prompts_per_step": 4, "group_size": 3, "max_new_tokens": 6},
            "optim": {"lr": lr, "minibatches": 2},
            "parallel": {"workers_per_node": workers},
        }
    )


def synthetic_groups(first_group: int, groups: int) -> tuple[list[Episode], torch.Tensor]:
    gen = torch.Generator().manual_seed(first_group)
    samples, index = [], []
    for g in range(first_group, first_group + groups):
        prompt = [0, 3] + torch.randint(8, 200, (4 + g,), generator=gen).tolist() + [4]
        for k in range(3):
            response = torch.randint(8, 200, (2 + (g + k) % 4,), generator=gen).tolist()
            samples.append(
                Episode.single(
                    prompt, response, [0.0] * len(response), "stop", float((g + k) % 2), bool((g + k) % 2), 0
                )
            )
            index.append(g - first_group)
    return samples, torch.tensor(index)


def test_two_workers_gradient_equals_one_worker_full_batch(tiny_bf16):
    """Loss shares use the global token count, so the all-reduced sum is the full-batch gradient.
    (lr 0: parameters stay put, so each minibatch's gradient is compared at the same point; Adam would
    amplify float summation-order noise on near-zero gradients into visible parameter differences.)"""
    samples, index = synthetic_groups(0, 4)  # groups 0, 1 go to rank 0 and 2, 3 to rank 1
    # optim.minibatches = 2: minibatch m is the union of every rank's m-th chunk, here groups {0, 2} then {1, 3}
    order = [i for g in (0, 2, 1, 3) for i in range(3 * g, 3 * g + 3)]
    single = LocalGroup(config(tiny_bf16, 1, lr=0.0), PROBLEMS)
    single.call("train", [samples[i] for i in order], index[order])
    expected = single.call("gradient_tensors")[0]

    pair = RayGroup(config(tiny_bf16, 2, lr=0.0), PROBLEMS)
    try:
        import ray

        first, first_index = synthetic_groups(0, 2)
        second, _ = synthetic_groups(0, 4)
        second, second_index = second[6:], index[6:] - 2
        ray.get([pair.workers[0].train.remote(first, first_index), pair.workers[1].train.remote(second, second_index)])
        got = pair.call("gradient_tensors")
    finally:
        pair.shutdown()
    assert sum(float(g.abs().sum()) for g in expected) > 0
    for mine, theirs, ref in zip(got[0], got[1], expected):
        assert torch.equal(mine, theirs)  # both ranks apply the same all-reduced gradient
        assert torch.allclose(mine, ref, rtol=1e-4, atol=1e-7)


def reward_config(base, **reward):
    c = config(base, 1)
    for key, value in reward.items():
        setattr(c.reward, key, value)
    return c


def test_reward_error_names_the_sample(tiny_bf16):
    w = RLWorker(reward_config(tiny_bf16, function="reward_functions:broken"), PROBLEMS)
    try:
        with pytest.raises(
            RewardError,
            match=r"reward reward_functions:broken failed on sample 0 of worker 0 \(prompt 'what is .*', "
            r"response .*ZeroDivisionError: bad verifier \(reward.on_error: fail\)",
        ):
            w.step(1)
    finally:
        w.shutdown()


def test_reward_errors_scored_as_wrong_are_counted(tiny_bf16):
    w = RLWorker(reward_config(tiny_bf16, function="reward_functions:broken", on_error="wrong"), PROBLEMS)
    try:
        metrics = w.step(1)
    finally:
        w.shutdown()
    assert metrics["reward_errors"] == metrics["samples_generated"] > 0  # every sample of every sampling round
    assert metrics["correct_sum"] == 0 and metrics["reward_sum"] <= 0


def test_held_out_evaluation_is_not_counted_as_the_next_steps_generation_work(tiny_bf16):
    """generate_tokens_per_second (a health signal) divides the step's engine positions by its generate time:
    the positions held-out evaluation computes between steps must not be added to the next step's."""
    w = RLWorker(config(tiny_bf16, 1), PROBLEMS)
    try:
        w.step(1)
        assert w.engine.positions == 0  # the step's report took them
        records = w.evaluate(PROBLEMS[:8], 2)
        assert len(records) == 16 and w.engine.positions == 0  # before: 16 responses' positions, counted in step 2
        assert w.engine.decode_slots == w.engine.decoded_tokens == 0
    finally:
        w.shutdown()


def test_an_evaluation_moves_neither_the_next_steps_samples_nor_its_own(tiny_bf16):
    """Evaluation draws from its own random stream (allsync.run.randomness.own_random_stream): a run evaluated after step 1 (as one
    stopped with --steps 1 is, before its checkpoint) samples at step 2 what a run that never evaluated samples, and
    the same adapter evaluated twice answers alike. Before, the evaluation drew from the run's stream, so the
    671B rehearsal's resumed step 2 sampled other responses than the run that never stopped."""
    straight, evaluated = RLWorker(config(tiny_bf16, 1), PROBLEMS), RLWorker(config(tiny_bf16, 1), PROBLEMS)
    sampled = ("reward_sum", "correct_sum", "response_tokens", "truncated", "entropy_sum", "loss_sum", "grad_norm")
    try:
        for step in (1, 2):
            if step == 2:
                first = evaluated.evaluate(PROBLEMS[:8], 2)
                assert len(first) == 16 and evaluated.evaluate(PROBLEMS[:8], 2) == first
            want, got = straight.step(step), evaluated.step(step)
            assert {k: got[k] for k in sampled} == {k: want[k] for k in sampled}, step
    finally:
        straight.shutdown()
        evaluated.shutdown()


def test_decode_fill_is_the_decode_tokens_over_the_slots_of_the_decode_forwards(warm_tiny):
    """Continuous batching (issue 46): every decode forward runs the pool's live rows, so decode_slots = slots x
    decode forwards, decoded_tokens = the tokens those forwards produced (each response's tokens but the first, which
    its prefill samples); fewer slot-steps than static batches of the same rows, each decoded to its longest
    response. A step reports both and aggregate their ratio."""
    from allsync.engines.torch_engine import Sampling

    w = RLWorker(config(warm_tiny, 1), PROBLEMS)
    try:
        engine = w.engine
        engine.batch_size = 4
        prompt = w.encode_prompt(PROBLEMS[0])
        prompts = [prompt[:k] for k in range(2, len(prompt) + 1)]  # cut prompts: responses of many lengths
        rollout = engine.generate(prompts, 1, Sampling(temperature=1.0, max_new_tokens=12))
        lengths = [len(r) for r in rollout.response_ids]
        static = sum(4 * max(lengths[i : i + 4]) for i in range(0, len(lengths), 4))
        assert engine.decoded_tokens == sum(lengths) - len(lengths) and len(set(lengths)) > 1
        assert engine.decode_slots % 4 == 0 and engine.decoded_tokens <= engine.decode_slots < static
        assert w.take_engine_counters()["decode_slots"] > 0 and engine.decode_slots == 0
        engine.batch_size = 64
        metrics = w.step(1)
        assert engine.decode_slots == engine.decoded_tokens == 0  # the step's report took them
        fill = metrics["decoded_tokens"] / metrics["decode_slots"]
        assert 0 < fill <= 1 and aggregate([metrics])["decode_fill"] == pytest.approx(fill)
    finally:
        w.shutdown()


def test_trained_samples_must_come_from_the_current_adapter(tiny_bf16, monkeypatch):
    w = RLWorker(config(tiny_bf16, 1), PROBLEMS)
    samples, index = synthetic_groups(0, 2)
    for episode in samples:
        episode.final.adapter_version = 7
    monkeypatch.setattr(
        w.producer,
        "collect",
        lambda groups, version: (
            samples,
            index,
            {"groups_generated": 2, "sampling_rounds": 1, "groups_kept": 2, "generated": samples},
        ),
    )
    with pytest.raises(RuntimeError, match=r"samples from adapter version 7 while training 0"):
        w.step(1)


def test_warmup_lr_ramps_linearly_then_holds():
    assert [round(update_module.warmup_lr(1e-3, s, 4), 6) for s in range(6)] == [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3]
    assert update_module.warmup_lr(1e-3, 0, 0) == 1e-3


def test_split_groups_deals_whole_groups_and_renumbers():
    from allsync.launch.disaggregated import split_groups

    samples = list("aabbbccdd")
    index = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3, 3])
    (first, first_index), (second, second_index) = split_groups(samples, index, 2)
    assert first == list("aabbb") and first_index.tolist() == [0, 0, 1, 1, 1]
    assert second == list("ccdd") and second_index.tolist() == [0, 0, 1, 1]


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_disaggregated_generators_receive_the_trained_adapter(warm_tiny):
    """The baseline layout: one generator, one trainer; after a step the generator serves the trainer's adapter."""
    from allsync.launch.disaggregated import DisaggregatedGroup
    from allsync.tasks import ArithmeticGenerator, make_splits

    cfg = config(warm_tiny, 2)
    cfg.algorithm.dynamic_sampling = False  # exactly 4 prompts x 3 samples
    cfg.rollout.max_new_tokens = 12  # "Answer: N<eos>"
    group = DisaggregatedGroup(cfg, make_splits(ArithmeticGenerator(1, 1), 100, 20).train)
    try:
        (trainer_metrics, generator_metrics) = group.step(1)
        import ray

        trained = ray.get(group.trainers[0].adapter_tensors.remote())
        served = ray.get(group.generators[0].adapter_tensors.remote())
    finally:
        group.shutdown()
    assert generator_metrics["samples_generated"] == 4 * 3 and trainer_metrics["samples_generated"] == 0
    assert trainer_metrics["trained_samples"] == 12 and generator_metrics["trained_samples"] == 0
    assert generator_metrics["sync_bytes"] == sum(t.numel() * t.element_size() for t in trained.values())
    assert trained.keys() == served.keys() and all(torch.equal(trained[k], served[k]) for k in trained)
    assert any(float(t.abs().sum()) > 0 for k, t in trained.items() if "lora_B" in k)  # the step changed B


def test_a_worker_collects_whole_groups_whatever_dynamic_sampling_keeps(warm_tiny):
    """Per-group advantage formulas (GRPO, Dr.GRPO) are exact over several workers because each worker holds whole
    groups: its producer generates all rollout.group_size samples of a prompt, and dynamic sampling keeps or drops
    a group whole, over rounds. Each group index a collect returns has exactly group_size episodes, of one prompt."""
    from allsync.tasks import ArithmeticGenerator, make_splits

    cfg = config(warm_tiny, 1)
    cfg.rollout.max_new_tokens = 12
    worker = RLWorker(cfg, make_splits(ArithmeticGenerator(1, 1), 100, 20).train)
    torch.manual_seed(0)
    for _ in range(2):
        episodes, group_index, stats = worker.producer.collect(4, worker.policy.version)
        assert stats["sampling_rounds"] >= 1 and len(episodes) == len(group_index) > 0
        for g in group_index.unique().tolist():
            members = [e for e, i in zip(episodes, group_index.tolist()) if i == g]
            assert len(members) == cfg.rollout.group_size
            assert len({tuple(e.final.prompt_ids) for e in members}) == 1  # one prompt's samples
            assert len({e.reward for e in members}) > 1  # dynamic sampling kept it: mixed rewards
