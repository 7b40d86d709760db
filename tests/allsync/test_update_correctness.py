"""The update step does exactly what the config says: N workers make one worker's update, empty minibatches
and skipped steps leave AdamW alone, the KL penalty exists when kl_coef > 0, dynamic sampling keeps what it
kept and filters on correctness, and a worker that raises stops the others."""

import time

import pytest
import torch

from allsync.config import parse_config
from allsync.launch.group import WorkerFailure
from allsync.launch.ray_actors import RayGroup
from allsync.engines.torch_engine import Rollout
from allsync.update.batches import recomputes_old_logprobs, reuses_update_forward
from allsync.update.sequences import logprob_gap
from allsync.tasks import Problem
from allsync.episodes import Episode
from allsync.run.worker import RLWorker

PROBLEMS = [Problem(f"what is {a}+{b}?", str(a + b)) for a in range(10) for b in range(10)]


def config(base, workers=1, lr=1e-3, minibatches=2, **algorithm):
    return parse_config(
        {
            "model": {"base": str(base), "quant": {"routed_experts": "nf4"}},
            "lora": {"rank": 4, "alpha": 8},
            "run": {"export": "merged"},
            "rollout": {"prompts_per_step": 4, "group_size": 3, "max_new_tokens": 6},
            "optim": {"lr": lr, "minibatches": minibatches, "weight_decay": 0.1},
            "parallel": {"workers_per_node": workers},
            "algorithm": algorithm,
        }
    )


def groups(seed: int, count: int, size: int = 3, spread: bool = False) -> tuple[list[Episode], torch.Tensor]:
    """`count` groups of `size` synthetic samples with mixed rewards and different lengths; spread: group g's rewards
    scaled by g + 1 (groups of different spreads: a batch's spread is not any part's)."""
    gen = torch.Generator().manual_seed(seed)
    samples, index = [], []
    for g in range(count):
        prompt = [0, 3] + torch.randint(8, 200, (4 + g,), generator=gen).tolist() + [4]
        for k in range(size):
            response = torch.randint(8, 200, (2 + (g + k) % 4,), generator=gen).tolist()
            samples.append(
                Episode.single(
                    prompt,
                    response,
                    [0.0] * len(response),
                    "stop",
                    float((g + k) % 2) * (g + 1 if spread else 1),
                    bool((g + k) % 2),
                    0,
                )
            )
            index.append(g)
    return samples, torch.tensor(index)


def adapter(worker_or_group) -> dict[str, torch.Tensor]:
    if isinstance(worker_or_group, RLWorker):
        return worker_or_group.adapter_tensors()
    return worker_or_group.call_ranks([0], "adapter_tensors")[0]


def trained(worker: RLWorker, samples, index) -> dict:
    out = worker.train(samples, index)
    worker.policy.version += 1
    return out


@pytest.mark.parametrize(
    "advantage",
    ["grpo", pytest.param("reinforce_pp_baseline", marks=pytest.mark.slow)],  # issue 70: 13 s each
)
def test_two_workers_equal_one_worker_over_several_steps_at_nonzero_lr(tiny_bf16, advantage):
    """Three real RL updates (2 AdamW steps each, lr 1e-3, weight decay 0.1): two Ray workers with half the
    batch each apply the one-worker gradient of the whole batch, and reach its adapter. REINFORCE++-baseline
    scales by the whole batch's reward spread: the workers sum their halves' (AdvantageEstimator.batch_sums).

    Float sums in another order differ by ~1e-4 of the largest gradient entry (per-token terms with +-
    advantages cancel), and Adam turns an entry whose gradient is within that noise of 0 into +-lr, so the
    adapters agree entry by entry except for such entries: >= 99% within 1e-6 (a rank missing from the
    all-reduce or another minibatch split moves most entries by ~lr)."""
    batches = [groups(seed, 4, spread=True) for seed in range(3)]
    single = RLWorker(config(tiny_bf16, advantage=advantage), PROBLEMS)
    pair = RayGroup(config(tiny_bf16, workers=2, advantage=advantage), PROBLEMS)
    flat = lambda tensors: torch.cat([t.flatten() for t in tensors])  # noqa: E731
    try:
        import ray

        for samples, index in batches:
            # minibatch m of the pair is the union of each rank's m-th part: rank 0 holds groups 0-1, rank 1 groups 2-3
            order = [i for g in (0, 2, 1, 3) for i in range(3 * g, 3 * g + 3)]
            trained(single, [samples[i] for i in order], torch.tensor([index[i] for i in order]))
            ray.get(
                [
                    pair.workers[0].train.remote(samples[:6], index[:6]),
                    pair.workers[1].train.remote(samples[6:], index[6:] - 2),
                ]
            )
            expected_grad, got_grad = flat(single.gradient_tensors()), flat(pair.call_ranks([0], "gradient_tensors")[0])
            assert float((got_grad - expected_grad).abs().max()) < 1e-3 * float(expected_grad.abs().max())
        got, theirs, expected = adapter(pair), pair.call_ranks([1], "adapter_tensors")[0], adapter(single)
    finally:
        pair.shutdown()
    assert all(torch.equal(t, theirs[k]) for k, t in got.items())  # the replicas are identical
    moved = flat(expected.values()) - flat(adapter(RLWorker(config(tiny_bf16, advantage=advantage), PROBLEMS)).values())
    diff = (flat(got.values()) - flat(expected.values())).abs()
    assert float((moved.abs() > 1e-4).float().mean()) > 0.5  # most entries moved by ~lr
    assert float((diff <= 1e-6).float().mean()) >= 0.99, f"{int((diff > 1e-6).sum())} of {diff.numel()} entries differ"
    assert float(diff.max()) < 0.5 * 1e-3


@pytest.mark.parametrize("advantage", ["grpo", "reinforce_pp_baseline"])
def test_a_rank_with_zero_samples_leaves_the_update_of_the_others_exact(tiny_bf16, advantage):
    """Rank 1 kept no group this step: the update is exactly rank 0's samples trained alone. The single worker
    computes with one thread like the Ray workers (a 2-thread matmul rounds differently: seen 1e-5 apart). An
    estimator with whole-batch sums (REINFORCE++-baseline) gets them from both ranks, the empty one included
    (without it rank 0 would wait in the all-reduce forever)."""
    samples, index = groups(0, 2)
    threads = torch.get_num_threads()
    try:
        single = RLWorker(config(tiny_bf16, advantage=advantage), PROBLEMS, threads=1)
        trained(single, samples, index)
    finally:
        torch.set_num_threads(threads)
    pair = RayGroup(config(tiny_bf16, workers=2, advantage=advantage), PROBLEMS)
    try:
        import ray

        outs = ray.get(
            [
                pair.workers[0].train.remote(samples, index),
                pair.workers[1].train.remote([], torch.zeros(0, dtype=torch.long)),
            ]
        )
        got = adapter(pair)
    finally:
        pair.shutdown()
    assert outs[1]["trained_samples"] == 0 and outs[0]["optimizer_steps"] == outs[1]["optimizer_steps"] == 2
    expected = adapter(single)
    # equal up to matmul rounding across processes (seen <= 1e-5); a rank 1 that contributed anything would move
    # entries by ~lr = 1e-2
    assert max(float((got[k] - expected[k]).abs().max()) for k in expected) < 5e-5


def test_an_empty_minibatch_is_no_optimizer_step(tiny_bf16):
    """One sample and optim.minibatches 2: the second part is empty on every rank, so AdamW steps once (its
    step count says so); a batch whose tokens are all masked moves nothing, weight decay included."""
    w = RLWorker(config(tiny_bf16, minibatches=2), PROBLEMS)
    samples, index = groups(0, 1, size=1)
    out = trained(w, samples, index)
    assert (out["optimizer_steps"], out["empty_minibatches"]) == (1, 1)
    assert {int(s["step"]) for s in w.policy.optimizer.state.values()} == {1}

    before = adapter(w)
    tb = w.learner.batches.episode_batch(*groups(1, 2))
    tb.sequences.response_mask.zero_()  # e.g. the overlong filter masked every response
    out = w.learner.update(w.policy, tb)
    assert (out["optimizer_steps"], out["empty_minibatches"]) == (0, 2)
    assert all(torch.equal(t, before[k]) for k, t in adapter(w).items())
    assert {int(s["step"]) for s in w.policy.optimizer.state.values()} == {1}


def test_a_fully_masked_batch_with_one_minibatch_is_no_step_and_no_error(tiny_bf16):
    """One minibatch takes its old logprobs from the update's forward; a batch whose tokens are all masked runs no
    forward, so there are none: no optimizer step, no logprob gap (before: a TypeError on the missing logprobs)."""
    w = RLWorker(config(tiny_bf16, minibatches=1), PROBLEMS)
    tb = w.learner.batches.episode_batch(*groups(0, 2))
    assert tb.old_logprobs is None
    tb.sequences.response_mask.zero_()  # e.g. the overlong filter masked every response
    out = w.learner.update(w.policy, tb)
    assert (out["optimizer_steps"], out["empty_minibatches"], out["logprob_gap"]) == (0, 1, 0.0)


def test_a_non_finite_gradient_with_a_finite_loss_skips_the_step(tiny_bf16):
    w = RLWorker(config(tiny_bf16, minibatches=1), PROBLEMS)
    before = adapter(w)
    w.policy.params[0].register_hook(lambda g: g * float("inf"))  # e.g. a bf16 overflow in one layer's backward
    out = trained(w, *groups(0, 2))
    assert out["nan_steps"] == 1 and out["optimizer_steps"] == 0 and out["loss_sum"] != 0
    assert all(torch.equal(t, before[k]) for k, t in adapter(w).items())
    state = w.policy.optimizer.state  # AdamW never stepped: its state as allocated, step 0 and zero moments
    assert all(int(state[p]["step"]) == 0 and not state[p]["exp_avg"].any() for p in w.policy.optimized)


def test_kl_to_the_reference_changes_the_update_and_is_logged(tiny_bf16):
    """The reference is the frozen base with the adapters off: equal to a model that never had LoRA.
    At step 1 (B = 0) the policy is the reference, so KL = 0 exactly; at step 2 it is > 0 and the
    penalty changes the update."""
    from quant.loader import QuantPlan, load_frozen_model
    from allsync.update.forward import forward_logprobs

    plain, with_kl = (
        RLWorker(config(tiny_bf16, minibatches=1), PROBLEMS),
        RLWorker(config(tiny_bf16, minibatches=1, kl_coef=0.5), PROBLEMS),
    )
    batches = [groups(seed, 2) for seed in range(2)]
    kl = []
    for samples, index in batches:
        trained(plain, samples, index)
        kl.append(trained(with_kl, samples, index)["kl_ref_sum"])
    assert kl[0] == 0.0 and kl[1] > 0
    a, b = adapter(plain), adapter(with_kl)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) > 1e-6

    tb = with_kl.learner.batches.episode_batch(*batches[0])
    base = load_frozen_model(tiny_bf16, QuantPlan(routed_experts="nf4"), compute_dtype=torch.float32)
    with torch.no_grad():
        reference = forward_logprobs(base, tb.sequences)
    mask = tb.sequences.response_mask.bool()
    assert torch.allclose(tb.ref_logprobs[mask], reference[mask], atol=1e-6)
    current = with_kl.learner.passes.current_logprobs(tb.sequences)
    assert not torch.allclose(current[mask], reference[mask], atol=1e-4)  # the trained policy moved away


def fake_rollout():
    def generate(prompts, n, sampling):
        count = len(prompts) * n
        return Rollout(
            [list(p) for p in prompts for _ in range(n)],
            [[5, 6, 7]] * count,
            [[0.0] * 3] * count,
            ["stop"] * count,
            0,
            [i // n for i in range(count)],
        )

    return generate


def test_dynamic_sampling_filters_on_correctness_not_the_shaped_reward(tiny_bf16, monkeypatch):
    """Two all-wrong groups whose shaped rewards differ only by an overlong penalty, one mixed group:
    filter_metric acc keeps only the mixed group (DAPO, verl); reward keeps all three."""
    kept = {}
    for metric in ("acc", "reward"):
        w = RLWorker(config(tiny_bf16, dynamic_sampling=True, filter_metric=metric, max_sampling_rounds=1), PROBLEMS)
        monkeypatch.setattr(w.engine, "generate", fake_rollout())
        correct = [False, False, False, False, False, False, True, False, True]
        rewards = [0.0, 0.0, -0.25, -0.5, 0.0, 0.0, 1.0, 0.0, 1.0]
        monkeypatch.setattr(
            w.scorer, "rewards", lambda problems, responses, group_index=None: (rewards, correct, 0)
        )  # 0 reward errors
        samples, group_index, stats = w.producer.collect(3, w.policy.version)
        kept[metric] = (stats["groups_kept"], stats["sampling_cap_hits"], len(samples))
    assert kept["acc"] == (1, 1, 3)  # 1 of 3 wanted kept: trained on (partial), the cap hit logged
    assert kept["reward"] == (3, 0, 9)


def test_sampling_cap_trains_on_the_groups_kept_or_fails_when_asked(tiny_bf16, monkeypatch):
    w = RLWorker(config(tiny_bf16, dynamic_sampling=True, max_sampling_rounds=2), PROBLEMS)
    monkeypatch.setattr(w.engine, "generate", fake_rollout())
    # per round of 2 groups: group 0 mixed, group 1 all correct -> 1 kept per round, 2 after the cap (3 wanted)
    # every round: group 0 mixed, the other groups all correct -> 1 group kept per round, 2 at the cap (3 wanted)
    pattern = lambda i: i % 3 != 1 if i < 3 else True  # noqa: E731
    monkeypatch.setattr(
        w.scorer,
        "rewards",
        lambda problems, responses, group_index=None: (
            [float(pattern(i)) for i in range(len(responses))],
            [pattern(i) for i in range(len(responses))],
            0,
        ),
    )
    samples, group_index, stats = w.producer.collect(3, w.policy.version)
    assert (stats["groups_kept"], stats["groups_wanted"], stats["sampling_cap_hits"], stats["sampling_rounds"]) == (
        2,
        3,
        1,
        2,
    )
    assert len(samples) == 6 and sorted(set(group_index.tolist())) == [0, 1]
    out = w.train(samples, group_index)
    assert out["trained_samples"] == 6 and out["optimizer_steps"] == 2

    w.config.algorithm.on_sampling_cap = "error"
    with pytest.raises(RuntimeError, match=r"kept only 2 after 2 rounds.*algorithm\.on_sampling_cap: error"):
        w.producer.collect(3, w.policy.version)


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_a_worker_that_raises_stops_the_others_and_is_named(tiny_bf16):
    """Rank 1's reward raises mid-step while rank 0 waits for it in the gradient all-reduce: the controller
    reports rank 1's error at once and stops every worker instead of hanging until gloo's timeout."""
    group = RayGroup(config(tiny_bf16, workers=2), PROBLEMS)
    try:
        import ray

        def break_rewards(worker):
            def broken(problems, responses, group_index=None):
                raise ZeroDivisionError("bad verifier on rank 1")

            worker.scorer.rewards = broken

        ray.get(group.workers[1].__ray_call__.remote(break_rewards))
        start = time.time()
        with pytest.raises(
            WorkerFailure, match=r"worker 1 failed in step: ZeroDivisionError: bad verifier on rank 1"
        ) as info:
            group.step(1)
        assert info.value.rank == 1 and time.time() - start < 120
        with pytest.raises(Exception):  # rank 0 was stopped too
            ray.get(group.workers[0].adapter_tensors.remote(), timeout=30)
    finally:
        group.shutdown()


def peak_saved_bytes(worker: RLWorker, samples, index) -> int:
    """The most bytes autograd saves for one backward during an update (distinct storages per forward+backward
    of a micro-batch): the activation memory the update needs at once."""
    peak, backward = [0], worker.learner.backward

    def counted(*args):
        storages: dict[int, int] = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            backward(*args)
        peak[0] = max(peak[0], sum(storages.values()))

    worker.learner.backward = counted
    trained(worker, samples, index)
    return peak[0]


@pytest.mark.parametrize(
    "optim",
    [
        {"max_tokens_per_forward": 30},
        {"max_tokens_per_forward": 30, "activation_checkpointing": True},
        {"activation_checkpointing": True},
        {"activation_checkpointing": True, "activation_offload": True},
        {"activation_offload": True},
    ],
)
def test_a_token_budget_and_activation_checkpointing_give_the_unsplit_update(tiny_bf16, optim, monkeypatch):
    """Micro-batches of at most optim.max_tokens_per_forward padded tokens (the logprob passes and each minibatch's
    forward+backward), and decoder layers recomputed in backward: the same old and reference logprobs and the same
    gradient as one forward over every row (KL to the reference on, per-episode means), with less saved for backward
    on the device. Offloaded, what the forward saves goes through save_on_cpu's hooks (counted by CountingSaveOnCpu:
    an outer hook sees nothing under them) and what stays is only backward's recomputation."""
    samples, index = groups(0, 4)
    offloaded = counting_save_on_cpu(monkeypatch)

    def worker(**extra):
        c = config(tiny_bf16, minibatches=2, kl_coef=0.5, loss_agg="seq-mean-token-mean")
        for key, value in extra.items():
            setattr(c.optim, key, value)
        return RLWorker(c, PROBLEMS)

    plain, split = worker(), worker(**optim)
    want, got = plain.learner.batches.episode_batch(samples, index), split.learner.batches.episode_batch(samples, index)
    if "max_tokens_per_forward" in optim:
        assert (
            len(split.learner.passes.forward_chunks(got.sequences)) >= 4
        )  # 12 rows of 9-16 tokens: 1-3 rows per forward
    mask = want.sequences.response_mask.bool()  # padded positions hold whatever the forward computed there
    for name in ("old_logprobs", "ref_logprobs"):
        # float32 rounding of another batch composition: up to 1.3e-5 at |logprob| ~ 11 (1.2e-6 of it)
        torch.testing.assert_close(getattr(got, name)[mask], getattr(want, name)[mask], atol=1e-5, rtol=2e-6)
    saved = [peak_saved_bytes(w, samples, index) for w in (plain, split)]
    g_want, g_got = (
        torch.cat([g.flatten() for g in plain.gradient_tensors()]),
        torch.cat([g.flatten() for g in split.gradient_tensors()]),
    )
    assert float((g_got - g_want).abs().max()) < 1e-4 * float(g_want.abs().max())
    assert saved[1] < saved[0]  # what stays on the device for backward
    if optim.get("activation_offload"):
        assert sum(offloaded) > 0
        if not optim.get("activation_checkpointing"):  # nothing recomputed: what the forward saved went to the host
            assert saved[1] < 0.01 * saved[0] and sum(offloaded) >= 0.99 * saved[0]  # (the loss's scalars stay)
    else:
        assert not offloaded


def counting_save_on_cpu(monkeypatch) -> list[int]:
    """torch.autograd.graph.save_on_cpu replaced by hooks that count the bytes of every tensor they take (returned
    list) and give back contiguous copies, as save_on_cpu does on a GPU (on a CPU it gives back the tensor itself)."""
    packed: list[int] = []

    class CountingSaveOnCpu(torch.autograd.graph.saved_tensors_hooks):
        def __init__(self, pin_memory: bool = False):
            def pack(t):
                packed.append(t.numel() * t.element_size())
                return t.device, t.detach().clone()

            super().__init__(pack, lambda p: p[1].to(p[0]))

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", CountingSaveOnCpu)
    return packed


def test_activation_offload_moves_what_the_forward_saves_and_leaves_recomputation_on_the_device(tiny_bf16, monkeypatch):
    """optim.activation_offload wraps the forward only: with activation checkpointing the host copies are the layers'
    inputs and the lm_head's input (what the plan counts as offloaded), a small share of what the forward saves
    without checkpointing; backward's recomputed layers are not offloaded. The hook stands in for save_on_cpu on a GPU:
    it gives back contiguous copies (on a CPU save_on_cpu gives back the tensor itself), which the recomputation of
    the chunked logprobs must accept."""
    samples, index = groups(0, 4)
    packed = counting_save_on_cpu(monkeypatch)
    offloaded = {}
    for checkpointing in (False, True):
        c = config(tiny_bf16, minibatches=1)
        c.optim.activation_offload, c.optim.activation_checkpointing = True, checkpointing
        worker = RLWorker(c, PROBLEMS)
        packed.clear()
        trained(worker, samples, index)
        offloaded[checkpointing] = sum(packed)
    assert 0 < offloaded[True] < 0.5 * offloaded[False]


@pytest.mark.parametrize("optim", [{}, {"max_tokens_per_forward": 40}])
def test_one_minibatch_takes_the_old_logprobs_from_its_own_forward(tiny_bf16, optim):
    """Issue 24: with one minibatch (group baselines) the update's own forward is the sampling policy's, so its
    detached logprobs are the old ones and no separate no-gradient pass runs. The update equals the one given
    the separate pass's old logprobs: the same loss, clip fractions, logprob gap and adapter, bit for bit here
    (token budget on: per micro-batch, put back at their rows)."""
    samples, index = groups(0, 4)
    workers = [RLWorker(config(tiny_bf16, minibatches=1, **{}), PROBLEMS) for _ in range(2)]
    for w in workers:
        for key, value in optim.items():
            setattr(w.config.optim, key, value)
    reused, separate = (w.learner.batches.episode_batch(samples, index) for w in workers)
    assert reuses_update_forward(workers[0].config) and reused.old_logprobs is None
    separate.old_logprobs = workers[1].learner.passes.current_logprobs(separate.sequences)
    passes = []
    original = workers[0].learner.passes.current_logprobs
    workers[0].learner.passes.current_logprobs = lambda *a: passes.append(1) or original(*a)
    outs = [w.learner.update(w.policy, tb) for w, tb in zip(workers, (reused, separate))]
    assert not passes  # no logprob pass besides the update's forward
    # the gap the update reports is the separate pass's: its own logprobs are the old ones, bit for bit
    gap = logprob_gap(separate.engine_logprobs, separate.old_logprobs, separate.sequences.response_mask)
    assert outs[0]["logprob_gap"] == gap
    for key in (
        "loss_sum",
        "loss_stat_clipfrac_high",
        "loss_stat_clipfrac_low",
        "loss_stat_approx_kl",
        "entropy_sum",
        "logprob_gap",
        "grad_norm",
        "trained_tokens",
    ):
        assert outs[0][key] == outs[1][key], key
    a, b = adapter(workers[0]), adapter(workers[1])
    assert all(torch.equal(a[k], b[k]) for k in a)


def with_engine_logprobs(samples, logprobs: torch.Tensor, mask: torch.Tensor) -> None:
    """Each sample's engine logprobs set to `logprobs` [B, L-1] at its response tokens (row i = sample i)."""
    for row, episode in enumerate(samples):
        n = len(episode.final.response_ids)
        start = int(mask[row].nonzero()[0])
        episode.final.engine_logprobs = logprobs[row, start : start + n].tolist()


def test_old_logprobs_from_the_torch_engine_skip_the_forward_and_give_the_recomputed_update(tiny_bf16):
    """algorithm.old_logprobs engine (two minibatches): the engine's logprobs are the old ones, so no no-gradient pass
    runs before the update. Where the engine's logprobs are the trainer's (the torch engine samples from this model)
    the update is the recomputed one bit for bit; the logprob gap then comes from the update's forwards before its
    first optimizer step (the first minibatch's rows): here 0, and with the engine's logprobs all 0 the mean
    |logprob| over exactly those rows."""
    samples, index = groups(0, 4)
    recompute = RLWorker(config(tiny_bf16), PROBLEMS)
    engine = RLWorker(config(tiny_bf16, old_logprobs="engine"), PROBLEMS)
    batch = recompute.learner.batches.episode_batch(samples, index)
    with_engine_logprobs(samples, batch.old_logprobs, batch.sequences.response_mask)
    passes = []
    original = engine.learner.passes.current_logprobs
    engine.learner.passes.current_logprobs = lambda *a: passes.append(1) or original(*a)
    outs = [trained(w, samples, index) for w in (recompute, engine)]
    assert not passes and not recomputes_old_logprobs(engine.config)
    for key in (
        "loss_sum",
        "loss_stat_clipfrac_high",
        "loss_stat_clipfrac_low",
        "loss_stat_approx_kl",
        "grad_norm",
        "trained_tokens",
    ):
        assert outs[0][key] == outs[1][key], key
    a, b = adapter(recompute), adapter(engine)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert outs[0]["logprob_gap"] < 1e-6 and outs[1]["logprob_gap"] < 1e-6

    samples, index = groups(1, 4)  # engine logprobs 0: the gap is the first minibatch's mean |trainer logprob|
    fresh = RLWorker(config(tiny_bf16, old_logprobs="engine"), PROBLEMS)
    tb = fresh.learner.batches.episode_batch(samples, index)
    first = tb.minibatch(tb.minibatch_rows(2)[0])
    expected = float(
        (fresh.learner.passes.current_logprobs(first.sequences).abs() * first.sequences.response_mask).sum()
    )
    expected /= float(first.sequences.response_mask.sum())
    assert fresh.learner.update(fresh.policy, tb)["logprob_gap"] == pytest.approx(expected, rel=1e-5) and expected > 1.0


def test_old_logprobs_engine_is_refused_where_the_engine_is_not_the_trainer(tiny_bf16):
    """A bad value, TIS (its weights would all be 1) and vLLM (its own weights and kernels) are refused by name."""
    from allsync.config import ConfigError

    with pytest.raises(ConfigError, match=r"algorithm.old_logprobs = 'sampler': use recompute"):
        config(tiny_bf16, old_logprobs="sampler")
    with pytest.raises(ConfigError, match=r"algorithm.old_logprobs engine with algorithm.tis"):
        config(tiny_bf16, old_logprobs="engine", tis={"level": "token"})
    raw = {
        "model": {"base": str(tiny_bf16)},
        "rollout": {"engine": "vllm"},
        "optim": {"minibatches": 2},
        "algorithm": {"old_logprobs": "engine"},
    }
    with pytest.raises(ConfigError, match=r"algorithm.old_logprobs engine with rollout.engine vllm"):
        parse_config(raw)
    # the torch engine sampling with other numbers than the trainer's: its own frozen copy, an FP8 cache, FP8 GEMMs
    unlike = [
        ({"engine_formats": {"routed_experts": "bf16"}}, {}, r"rollout\.engine_formats \{'routed_experts': 'bf16'\}"),
        ({"kv_cache_dtype": "fp8"}, {}, r"rollout\.kv_cache_dtype fp8"),
        ({"fp8_linear_kernel": "scaled_mm"}, {"attention": "fp8"}, r"rollout\.fp8_linear_kernel scaled_mm"),
    ]
    for rollout, quant, named in unlike:
        data = {**raw, "rollout": rollout, "model": {"base": str(tiny_bf16), "quant": quant}}
        with pytest.raises(ConfigError, match=rf"algorithm\.old_logprobs engine with {named}: .*PPO ratio"):
            parse_config(data)
        data["algorithm"] = {"old_logprobs": "recompute", "tis": {"level": "token"}}
        parse_config(data)  # the same engine with the ratio's own forward, TIS correcting the mismatch


def test_tis_weights_the_update_by_the_engines_logprobs_and_is_logged(tiny_bf16):
    """algorithm.tis: with the engine's logprobs equal to the trainer's the weights are 1 and the gradient is the
    uncorrected one; with the engine at logprob 0 (p = 1) every token's weight is exp(old logprob), as logged."""
    samples, index = groups(5, 2)
    plain = RLWorker(config(tiny_bf16, lr=0.0), PROBLEMS)
    corrected = RLWorker(config(tiny_bf16, lr=0.0, tis={"level": "token", "cap": 2.0}), PROBLEMS)
    batch = corrected.learner.batches.episode_batch(samples, index)
    mask = batch.sequences.response_mask
    expected_mean = float((batch.old_logprobs.exp() * mask).sum() / mask.sum())  # engine logprobs 0 in `groups`
    out = corrected.train(samples, index)
    assert out["tis_sum"] / out["trained_tokens"] == pytest.approx(expected_mean, rel=1e-4) and expected_mean < 0.5
    assert out["tis_capped_sum"] == 0.0 and "tis_sum" not in plain.train(samples, index)

    for episode, row in zip(samples, range(len(samples))):  # the engine computed exactly the trainer's logprobs
        n = len(episode.final.response_ids)
        start = int(mask[row].nonzero()[0])
        episode.final.engine_logprobs = batch.old_logprobs[row, start : start + n].tolist()
    same = corrected.train(samples, index)
    assert same["tis_sum"] == pytest.approx(same["trained_tokens"], rel=1e-6) and same["tis_capped_sum"] == 0.0
    plain.train(samples, index)
    for a, b in zip(plain.gradient_tensors(), corrected.gradient_tensors()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-8)


def test_tis_settings_are_checked_naming_the_key(tiny_bf16):
    from allsync.config import ConfigError

    with pytest.raises(ConfigError, match=r"algorithm.tis.level = 'episode': use token or sequence"):
        config(tiny_bf16, tis={"level": "episode"})
    with pytest.raises(ConfigError, match=r"algorithm.tis.cap = 0.5: must be >= 1"):
        config(tiny_bf16, tis={"cap": 0.5})


def test_adamw_state_is_held_before_the_engine_is_built_and_a_resume_loads_into_it(tiny_bf16, tmp_path, monkeypatch):
    """Issue 44 item 2: a colocated vLLM reads the memory left free when it is built; AdamW's moments must be held by
    then, not allocated by the first optimizer.step() after the engine took that memory for its KV cache. The
    preallocated state is what AdamW's first step makes (the same update), and a resume copies the saved state into
    those tensors (no second copy of the moments)."""
    from allsync.run.worker import RLWorker as Worker

    seen = {}
    make_engine = Worker._make_engine

    def spied(self):
        state = self.policy.optimizer.state
        seen["moment_bytes"] = sum(
            state[p][name].numel() * state[p][name].element_size()
            for p in self.policy.optimized
            if p in state
            for name in ("exp_avg", "exp_avg_sq")
        )
        return make_engine(self)

    monkeypatch.setattr(Worker, "_make_engine", spied)
    samples, index = groups(0, 4)
    fresh = Worker(config(tiny_bf16, minibatches=1), PROBLEMS)
    adapter_bytes = sum(p.numel() * p.element_size() for p in fresh.policy.optimized)
    assert seen["moment_bytes"] == 2 * adapter_bytes > 0
    # the same update as a lazily initialized AdamW: a learner whose state is dropped before its first step
    lazy = Worker(config(tiny_bf16, minibatches=1), PROBLEMS)
    lazy.policy.optimizer.state.clear()
    for w in (fresh, lazy):
        trained(w, samples, index)
    for a, b in zip(fresh.policy.optimized, lazy.policy.optimized):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    fresh.save_state(str(tmp_path))
    resumed = Worker(config(tiny_bf16, minibatches=1), PROBLEMS)
    held = {
        id(p): {n: t.data_ptr() for n, t in resumed.policy.optimizer.state[p].items()} for p in resumed.policy.optimized
    }
    resumed.load_state(str(tmp_path))
    for p, q in zip(resumed.policy.optimized, fresh.policy.optimized):
        state, want = resumed.policy.optimizer.state[p], fresh.policy.optimizer.state[q]
        assert {n: t.data_ptr() for n, t in state.items()} == held[id(p)]  # loaded in place
        for name in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[name], want[name], atol=0, rtol=0)


def test_balanced_ranks_make_the_one_worker_update_with_even_tokens(tiny_bf16):
    """optim.balance_ranks (issue 48, lever 4): rank 0 generated 9 samples, rank 1 3; before the update the rows move
    so that each trains nearly half the tokens (whole episodes, longest first to the emptier rank), and the update is
    the one worker's of all 12 samples (one minibatch: the same token-mean loss, float sums in another order); rank 1
    with no samples at all receives rows too."""
    samples, index = groups(0, 4)
    threads = torch.get_num_threads()
    try:
        single = RLWorker(config(tiny_bf16, minibatches=1), PROBLEMS, threads=1)
        trained(single, samples, index)
    finally:
        torch.set_num_threads(threads)
    c = config(tiny_bf16, workers=2, minibatches=1)
    c.optim.balance_ranks = True
    flat = lambda tensors: torch.cat([t.flatten() for t in tensors])  # noqa: E731
    pair = RayGroup(c, PROBLEMS)
    try:
        import ray

        outs = ray.get(
            [
                pair.workers[0].train.remote(samples[:9], index[:9]),
                pair.workers[1].train.remote(samples[9:], index[9:] - 3),
            ]
        )
        got_grad = flat(pair.call_ranks([0], "gradient_tensors")[0])
        got = adapter(pair)
        alone = ray.get(
            [
                pair.workers[0].train.remote(samples, index),
                pair.workers[1].train.remote([], torch.zeros(0, dtype=torch.long)),
            ]
        )
    finally:
        pair.shutdown()
    expected_grad = flat(single.gradient_tensors())
    assert float((got_grad - expected_grad).abs().max()) < 1e-3 * float(expected_grad.abs().max())
    expected = adapter(single)
    assert max(float((got[k] - expected[k]).abs().max()) for k in expected) < 5e-5
    positions = [o["train_positions"] for o in outs]  # padded positions each rank trained: 9 rows against 3 before
    assert max(positions) < 1.35 * min(positions), positions
    assert outs[0]["trained_samples"] == 9 and outs[1]["trained_samples"] == 3  # what each generated (the metric)
    assert min(o["train_positions"] for o in alone) > 0  # the rank without samples trained some of the other's rows
