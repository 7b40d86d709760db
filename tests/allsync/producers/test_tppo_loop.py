"""T-PPO in the loop: generation windows over a pool of in-flight responses, EGAE advantages from a critic (its own
LoRA on the frozen base), each token trained once by the adapter that generated it, staleness of continuing
responses reported."""

import pytest
import torch

from allsync.algorithms import egae, whiten_advantages, whitening_sums
from allsync.config import ConfigError, parse_config
from allsync.metrics import aggregate
from allsync.tasks import ArithmeticGenerator, make_splits
from allsync.update.batches import reuses_update_forward
from allsync.update.sequences import (
    build_sequences,
    logprob_gap,
    response_positions,
    to_response_layout,
    to_sequence_layout,
)
from allsync.producers.windows import PartialResponse
from allsync.run.worker import RLWorker

WINDOW, MAX_NEW = 4, 12  # "Answer: N<eos>" takes 6-7 tokens: every response spans two windows


def tppo_config(base, lr=1e-3, **algorithm):
    return parse_config(
        {
            "model": {"base": str(base), "quant": {"routed_experts": "nf4"}},
            "lora": {"rank": 8, "alpha": 16},
            "rollout": {"prompts_per_step": 3, "group_size": 2, "max_new_tokens": MAX_NEW},
            "producer": {"kind": "windows", "window": WINDOW},
            "algorithm": {"advantage": "egae", "dynamic_sampling": False, **algorithm},
            "optim": {"lr": lr, "value_lr": 1e-2},
            "parallel": {"workers_per_node": 1},
        }
    )


@pytest.fixture(scope="module")
def problems():
    return make_splits(ArithmeticGenerator(1, 1), 100, 20).train


def test_layouts_move_response_tokens_to_column_zero_and_back():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.float)
    x = torch.arange(18, dtype=torch.float).view(3, 6)
    index, valid = response_positions(mask)
    aligned = to_response_layout(x, index, valid)
    assert aligned.tolist() == [[2, 3, 4], [7, 8, 0], [17, 0, 0]]
    assert torch.equal(to_sequence_layout(aligned, index, valid, 6), x * mask)


def test_critic_batch_bootstraps_cut_responses_and_rewards_finished_ones(warm_tiny, problems):
    worker = RLWorker(tppo_config(warm_tiny), problems)
    torch.nn.init.normal_(worker.policy.critic.head.weight, std=0.3)  # a critic with nonzero values
    prompt = worker.encode_prompt(problems[0])
    finished = PartialResponse(problems[0], prompt, [10, 11, 12, 13, 14, 15], [0.0] * 6, window_start=4)
    cut = PartialResponse(problems[0], prompt, [20, 21, 22, 23], [0.0] * 4, window_start=0)
    episodes = [finished.episode("stop", 1.0, True, 0), cut.episode("window", 0.0, False, 0)]
    assert episodes[0].final.loss_mask == [0, 0, 0, 0, 1, 1]  # the latest window's tokens
    tb = worker.learner.batches.critic_batch(episodes, worker.policy.critic)

    full = build_sequences([prompt, prompt], [finished.response_ids, cut.response_ids], worker.tokenizer.pad_token_id)
    index, valid = response_positions(full.response_mask)
    policy = to_response_layout(tb.sequences.response_mask, index, valid)
    assert policy.tolist() == [[0, 0, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0]]  # this window's tokens only
    assert tb.value_mask[0].sum() == 6 and tb.value_mask[1].sum() == 0  # the critic learns from finished ones only
    with torch.no_grad():
        values = worker.policy.critic(full)
    v = to_response_layout(values, index, valid)
    adv = to_response_layout(tb.advantages, index, valid)
    raw, _ = egae(
        torch.tensor([[0, 0, 0, 0, 0, 1.0], [0] * 6]), v, valid.float(), torch.tensor([False, True]), 1.0, 0.95
    )
    # finished, gamma 1: the last token's advantage is reward - V(s_5); cut: r + V(s_3) - V(s_3) = 0 (bootstrap)
    assert raw[0, 5].item() == pytest.approx(1.0 - v[0, 5].item(), abs=1e-5) and raw[1, 3].item() == pytest.approx(
        0.0, abs=1e-6
    )
    expected = whiten_advantages(raw, policy, whitening_sums(raw, policy)).float()  # over this window's tokens
    assert torch.allclose(adv, expected, atol=1e-5) and (adv * policy).sum().abs() < 1e-4
    worker.learner.config.algorithm.whiten = "scale"  # the same batch, only scaled: each token keeps its sign
    scaled = to_response_layout(
        worker.learner.batches.critic_batch(episodes, worker.policy.critic).advantages, index, valid
    )
    expected = whiten_advantages(raw, policy, whitening_sums(raw, policy), center=False).float()
    assert torch.allclose(scaled, expected, atol=1e-5) and torch.equal(scaled.sign(), (raw * policy).sign())
    cut_sum, cut_tokens, finished_sum, finished_tokens = tb.critic_sums["advantage_split_sums"].tolist()
    assert (cut_tokens, finished_tokens) == (4, 2)  # the trained tokens: the cut row's window, the finished one's
    assert cut_sum == pytest.approx(float(raw[1, :4].sum()), abs=1e-5)
    assert finished_sum == pytest.approx(float(raw[0, 4:].sum()), abs=1e-5)


def test_the_cut_and_finished_advantage_means_add_up_over_workers():
    from allsync.metrics import value_fit_metric

    workers = [{"advantage_split_sums": [-1.0, 2.0, 3.0, 4.0]}, {"advantage_split_sums": [-2.0, 4.0, 0.0, 0.0]}]
    assert value_fit_metric(workers) == {"advantage_cut_mean": -0.5, "advantage_finished_mean": 0.75}
    assert value_fit_metric([{"advantage_split_sums": [0.0, 0.0, 1.0, 2.0]}]) == {"advantage_finished_mean": 0.5}


def test_whitening_is_hand_computed_and_shards_add_up():
    a = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # mean 2, variance 2/3
    assert whiten_advantages(a, m).tolist()[0] == pytest.approx([-1.224745, 0.0, 1.224745, 0.0], abs=1e-5)
    halves = whitening_sums(a[:, :2], m[:, :2]) + whitening_sums(a[:, 2:], m[:, 2:])  # what the all-reduce adds
    assert torch.equal(halves, whitening_sums(a, m))
    # algorithm.whiten scale: the same standard deviation, no mean taken off (each token keeps its sign)
    scaled = whiten_advantages(a, m, center=False).tolist()[0]
    assert scaled == pytest.approx([1.224745, 2.449490, 3.674235, 0.0], abs=1e-5)


def test_windows_continue_responses_train_each_token_once_and_report_staleness(warm_tiny, problems):
    worker = RLWorker(tppo_config(warm_tiny), problems)
    pool_size = 3 * 2
    history = []
    for step in range(1, 5):
        m = worker.step(step)
        history.append(m)
        assert len(worker.producer.in_flight) == pool_size  # refilled to a constant pool
        assert m["trained_tokens"] <= pool_size * WINDOW
        assert m["logprob_gap"] < 1e-3  # continuation tokens and logprobs line up with the trainer's
    first, second = history[0], history[1]
    assert first["continuing"] == pool_size and first["samples_generated"] == 0  # nothing ends inside 4 tokens
    assert first["staleness_max"] == 0 and second["staleness_max"] == 1  # continued from the previous adapter
    assert first["trained_tokens"] == pool_size * WINDOW
    assert "reward" not in aggregate([first])  # no response finished: no mean reward, rather than a false 0
    done = next(m for m in history if m["samples_generated"])
    assert aggregate([done])["reward"] == pytest.approx(done["reward_sum"] / done["samples_generated"])
    # every step re-prefills each response's prompt and reply so far: more positions computed than tokens trained
    per_token = [aggregate([m])["positions_per_trained_token"] for m in history]
    assert per_token == pytest.approx([m["engine_positions"] / m["trained_tokens"] for m in history])
    assert min(per_token) > 1
    finished = sum(m["samples_generated"] for m in history)
    assert finished >= pool_size and sum(m["response_tokens"] for m in history) >= finished * 5
    assert worker.policy.version == 4


def test_window_state_survives_a_checkpoint(warm_tiny, problems, tmp_path):
    a = RLWorker(tppo_config(warm_tiny, lr=1e-2), problems)
    for step in (1, 2, 3):
        a.step(step)
    a.save_state(str(tmp_path))
    in_flight = [r.response_ids for r in a.producer.in_flight]
    expected = a.step(4)
    b = RLWorker(tppo_config(warm_tiny, lr=1e-2), problems)
    b.load_state(str(tmp_path))
    assert [r.response_ids for r in b.producer.in_flight] == in_flight and len(in_flight) == 6
    got = b.step(4)
    for key in ("reward_sum", "samples_generated", "continuing", "trained_tokens", "loss_sum", "staleness_max"):
        assert got[key] == pytest.approx(expected[key], abs=1e-6), key


def test_on_resume_the_configs_optim_settings_win_over_the_saved_ones(warm_tiny, problems, tmp_path, capsys):
    """AdamW's load_state_dict brings back the saved groups' lr, betas and weight decay: the worker sets this
    config's again (the moments are kept) and names every change."""
    a = RLWorker(tppo_config(warm_tiny, lr=1e-2), problems)
    a.step(1)
    a.save_state(str(tmp_path))
    changed = tppo_config(warm_tiny, lr=5e-3)
    changed.optim.value_lr, changed.optim.betas, changed.optim.weight_decay = 2e-3, [0.8, 0.95], 0.1
    b = RLWorker(changed, problems)
    b.load_state(str(tmp_path))
    groups = b.policy.optimizer.param_groups
    assert [(g["base_lr"], g["betas"], g["weight_decay"]) for g in groups] == [
        (5e-3, (0.8, 0.95), 0.1),
        (2e-3, (0.8, 0.95), 0.1),
    ]
    assert b.policy.optimizer.state_dict()["state"]  # the moments came back
    note = capsys.readouterr().err
    assert (
        "note: resumed with this config's optim settings: param group 0 base_lr: 0.01 -> 0.005; param group 0 betas: (0.9, 0.99) -> (0.8, 0.95)"
        in note
    )
    assert "param group 1 base_lr: 0.01 -> 0.002" in note and "param group 1 weight_decay: 0.0 -> 0.1" in note


def test_the_critics_gradient_has_its_own_clip_and_norm(warm_tiny, problems):
    """Policy and value model are optimized independently (T-PPO): each gradient is clipped to optim.grad_clip by
    its own norm, and grad_norm is the policy's alone (value_grad_norm the critic's). Before: one norm over both,
    so a large critic gradient shrank the policy's step and showed up in grad_norm."""
    config = tppo_config(warm_tiny)
    config.optim.grad_clip = 1e-6  # both gradients are far larger: each is scaled to exactly this norm
    config.reward.function = "reward_functions:length_bonus"  # +1 / -0.5: never all zero, as the weak base's 0/1 can be
    worker = RLWorker(config, problems)
    m = [worker.step(step) for step in (1, 2, 3)][-1]  # responses finished in step 3: both models get a gradient
    trained = worker.policy
    norm = lambda params: float(torch.nn.utils.get_total_norm([p.grad for p in params]))  # noqa: E731 - after the clip
    assert m["optimizer_steps"] == 1 and m["grad_norm"] > 1e-3 and m["value_grad_norm"] > 1e-3
    assert norm(trained.lora_params) == pytest.approx(1e-6, rel=1e-3)
    assert norm(trained.value_params) == pytest.approx(1e-6, rel=1e-3)


def test_the_critic_shares_the_frozen_base_and_trains_only_its_own_adapter(warm_tiny, problems):
    """The critic is the frozen base under its own LoRA (no routed-expert adapter) plus a head: the same frozen
    storage as the policy, its own A/B tensors; fresh, it values the base's features (B = 0); the value loss's
    gradient reaches only its adapter and head, the policy loss's only the policy's."""
    from allsync.update.critic import ValueTargets, critic_loss
    from allsync.update.forward import forward_pass
    from moe_lora.lora import LoRAExperts, LoRALinear, adapters_disabled
    from quant.modules import FrozenExperts

    worker = RLWorker(tppo_config(warm_tiny), problems)
    policy, critic = worker.model, worker.policy.critic
    frozen_policy = {id(p) for p in policy.parameters() if not p.requires_grad}
    frozen_critic = {id(p) for p in critic.model.parameters() if not p.requires_grad}
    assert frozen_critic and frozen_critic <= frozen_policy  # embeddings, norms, routers: shared, not copied
    critic_modules = dict(critic.model.named_modules())
    shared = [(m, critic_modules[n]) for n, m in policy.model.named_modules() if isinstance(m, LoRALinear)]
    assert shared and all(a.base is b.base and a.lora_A is not b.lora_A for a, b in shared)
    assert not any(isinstance(m, LoRAExperts) for m in critic.model.modules())
    assert any(isinstance(m, FrozenExperts) for m in critic.model.modules())
    policy_ids = {id(p) for p in worker.policy.lora_params}
    assert not policy_ids & {id(p) for p in worker.policy.value_params}
    assert all(not torch.equal(a.lora_A, b.lora_A) for a, b in shared)  # drawn apart

    torch.nn.init.normal_(critic.head.weight, std=0.3)
    prompt = worker.encode_prompt(problems[0])
    batch = build_sequences([prompt, prompt], [[10, 11, 12], [20, 21]], worker.tokenizer.pad_token_id)
    with torch.no_grad(), adapters_disabled(policy):
        hidden = policy.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        expected = critic.head(hidden[:, :-1].float()).squeeze(-1)
        assert torch.allclose(critic(batch), expected, atol=1e-5)  # B = 0: the base's features

    trained = worker.policy  # gradients land in its flat buffers (views), zero before a backward
    moved = lambda params: sum(float(p.grad.abs().sum()) for p in params)  # noqa: E731
    targets = ValueTargets(torch.ones_like(batch.response_mask), batch.response_mask, batch.response_mask.sum())
    loss, share = critic_loss(critic, batch, targets)
    loss.backward()
    assert float(share) > 0 and moved(trained.lora_params) == 0
    b_grads = [m.lora_B.grad for m in critic.model.modules() if isinstance(m, LoRALinear)]
    assert all(float(g.abs().sum()) > 0 for g in b_grads)  # every adapter of the critic
    trained.flat_grad.zero_()
    (-forward_pass(policy, batch).logprobs.mean()).backward()
    assert moved(trained.value_params) == 0 and moved(trained.lora_params) > 0


def test_value_pretraining_moves_only_the_critic_then_both(warm_tiny, problems):
    """algorithm.value_pretrain_steps 3: steps 1-3 train the critic alone (the policy's adapter bit for bit as it
    started), step 4 both. AdamW steps the critic in the steps whose windows finished a reply (value targets) only:
    step 1's replies all outlast their first window."""
    config = tppo_config(warm_tiny, lr=1e-2, value_pretrain_steps=3)
    config.reward.function = "reward_functions:length_bonus"  # +1 / -0.5: the critic always has something to learn
    worker = RLWorker(config, problems)
    trained = worker.policy
    snapshot = lambda params: [p.detach().clone() for p in params]  # noqa: E731
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b))  # noqa: E731
    policy0, critic0 = snapshot(trained.lora_params), snapshot(trained.value_params)
    pretraining = [worker.step(step) for step in (1, 2, 3)]
    m = pretraining[-1]
    critic_steps = sum(r["value_loss_sum"] > 0 for r in pretraining)  # a step with a finished reply: value targets
    assert pretraining[0]["value_loss_sum"] == 0 and critic_steps >= 1
    assert same(policy0, trained.lora_params) and m["grad_norm"] == 0.0
    assert not same(critic0, trained.value_params) and m["value_loss_sum"] > 0
    state = trained.optimizer.state
    for p in trained.lora_params:  # AdamW never stepped the policy: its state as allocated (step 0, zero moments)
        assert int(state[p]["step"]) == 0 and not state[p]["exp_avg"].any() and not state[p]["exp_avg_sq"].any()
    assert all(int(state[p]["step"]) == critic_steps for p in trained.value_params)
    policy3 = snapshot(trained.lora_params)
    m = worker.step(4)
    assert not same(policy3, trained.lora_params) and m["grad_norm"] > 0
    assert all(int(state[p]["step"]) == 1 for p in trained.lora_params)
    assert all(int(state[p]["step"]) == critic_steps + (m["value_loss_sum"] > 0) for p in trained.value_params)
    # AdamW's first step moves every coordinate with a gradient by lr * g / |g| (bias-corrected m / sqrt(v) = sign g):
    # exactly the configured size. Had the 3 critic-only steps advanced the policy's count, the size would be
    # lr * (1 - b1) / (1 - b1^4) * sqrt((1 - b2^4) / (1 - b2)) = 0.58 lr (betas 0.9, 0.99).
    moves = torch.cat([(p.detach() - p0).abs().flatten() for p, p0 in zip(trained.lora_params, policy3)])
    grads = torch.cat([p.grad.abs().flatten() for p in trained.lora_params])  # the step's (clipped) gradient
    moved_by = moves[grads > 1e-4]  # AdamW's eps (1e-8) is < 1e-4 of these gradients
    assert moved_by.numel() > 0 and torch.allclose(moved_by, torch.full_like(moved_by, 1e-2), rtol=1e-3)


def test_the_critic_learns_monte_carlo_returns_by_default(warm_tiny, problems):
    """value_lam 1 (decoupled GAE): a finished response's value targets are its reward at every token, whatever the
    critic says; the advantages keep algorithm.lam's bootstrap."""
    worker = RLWorker(tppo_config(warm_tiny), problems)
    torch.nn.init.normal_(worker.policy.critic.head.weight, std=0.3)
    prompt = worker.encode_prompt(problems[0])
    finished = PartialResponse(problems[0], prompt, [10, 11, 12, 13, 14, 15], [0.0] * 6, window_start=4)
    tb = worker.learner.batches.critic_batch([finished.episode("stop", 1.0, True, 0)], worker.policy.critic)
    returns = tb.returns[tb.value_mask > 0]
    assert returns.tolist() == pytest.approx([1.0] * 6, abs=1e-6)
    assert worker.config.algorithm.lam == 0.95 and tb.advantages.abs().sum() > 0


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"producer": {"kind": "windows", "window": 4}, "algorithm": {"dynamic_sampling": False}},
            r"producer\.kind windows with algorithm\.advantage grpo",
        ),
        (
            {
                "producer": {"kind": "windows", "window": 4},
                "algorithm": {"advantage": "gae", "dynamic_sampling": False},
            },
            r"producer\.window = 4 with algorithm\.advantage gae",
        ),
        (
            {"producer": {"kind": "windows"}, "algorithm": {"advantage": "egae", "dynamic_sampling": False}},
            r"algorithm\.advantage egae needs producer\.window",
        ),
        (
            {
                "producer": {"kind": "windows", "window": 40},
                "algorithm": {"advantage": "egae", "dynamic_sampling": False},
            },
            r"producer\.window = 40: must be in 1\.\.rollout\.max_new_tokens",
        ),
        (
            {"algorithm": {"advantage": "gae", "dynamic_sampling": False}},
            r"algorithm\.advantage gae learns a critic.*producer: \{kind: windows\}",
        ),
        (
            {"producer": {"kind": "windows", "window": 4}, "algorithm": {"advantage": "egae"}},
            r"algorithm\.dynamic_sampling with algorithm\.advantage egae",
        ),
        ({"algorithm": {"advantage": "gae", "dynamic_sampling": False, "lam": 1.5}}, r"algorithm\.lam = 1\.5"),
        (
            {
                "producer": {"kind": "windows"},
                "algorithm": {"advantage": "gae", "dynamic_sampling": False},
                "parallel": {"layout": "disaggregated"},
            },
            r"parallel\.layout disaggregated with algorithm\.advantage gae",
        ),
        ({"rollout": {"window": 4}}, r"'rollout\.window' has moved: write producer: \{kind: windows, window: N\}"),
    ],
)
def test_critic_configs_name_the_key(data, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(data, "x.yaml")


def test_the_critic_trains_on_finished_rows_only_with_the_loss_and_gradient_of_every_row(warm_tiny, problems):
    """critic_loss runs the critic on the rows that have value targets (a T-PPO window's continuing responses have
    none): the loss and the critic's gradient equal value_loss over every row's values; a micro-batch with no
    target still runs one (masked) row and moves nothing."""
    from allsync.algorithms import value_loss
    from allsync.update.critic import ValueTargets, critic_loss

    worker = RLWorker(tppo_config(warm_tiny), problems)
    critic, params = worker.policy.critic, worker.policy.value_params
    torch.nn.init.normal_(critic.head.weight, std=0.3)
    prompts = [worker.encode_prompt(p) for p in problems[:3]]
    batch = build_sequences(prompts, [[10, 11, 12, 13, 14], [20, 21], [30, 31, 32]], worker.tokenizer.pad_token_id)
    mask = batch.response_mask * torch.tensor([[0.0], [1.0], [0.0]])  # the short middle row finished
    returns = torch.full_like(mask, 0.7)
    targets = ValueTargets(returns, mask, mask.sum())

    def gradient(loss):
        for p in params:
            p.grad = None
        loss.backward()
        return [p.grad.clone() for p in params]

    loss, share = critic_loss(critic, batch, targets)
    selected = gradient(loss)
    full, _ = value_loss(critic(batch), returns, mask, mask.sum(-1) > 0, global_tokens=float(mask.sum()))
    everything = gradient(full)
    assert float(share) == pytest.approx(float(full), rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(selected, everything))
    none = ValueTargets(returns, torch.zeros_like(mask), 0.0)
    loss, share = critic_loss(critic, batch, none)
    assert float(share) == 0.0 and all(float(g.abs().sum()) == 0 for g in gradient(loss))


def test_one_minibatch_with_a_critic_takes_the_old_logprobs_from_its_own_forward(warm_tiny, problems):
    """With one minibatch the policy's old logprobs come from the update's own forward (no separate pass), as with
    group baselines; the critic's values still come before the update. The same update as when given a separate
    pass's old logprobs, bit for bit."""
    config = lambda: tppo_config(warm_tiny, lr=1e-2)  # noqa: E731
    workers = [RLWorker(config(), problems) for _ in range(2)]
    prompt = workers[0].encode_prompt(problems[0])
    responses = [
        PartialResponse(problems[0], prompt, [10, 11, 12, 13, 14, 15], [0.0] * 6, window_start=4),
        PartialResponse(problems[1], prompt, [20, 21, 22, 23], [0.0] * 4, window_start=0),
    ]
    episodes = [responses[0].episode("stop", 1.0, True, 0), responses[1].episode("window", 0.0, False, 0)]
    reused, separate = (w.learner.batches.critic_batch(episodes, w.policy.critic) for w in workers)
    assert reuses_update_forward(workers[0].config) and reused.old_logprobs is None
    separate.old_logprobs = workers[1].learner.passes.current_logprobs(separate.sequences)
    outs = [w.learner.update(w.policy, tb) for w, tb in zip(workers, (reused, separate))]
    # the gap the update reports is the separate pass's: its own logprobs are the old ones, bit for bit
    gap = logprob_gap(separate.engine_logprobs, separate.old_logprobs, separate.sequences.response_mask)
    assert outs[0]["logprob_gap"] == gap
    for key in ("loss_sum", "value_loss_sum", "grad_norm", "value_grad_norm", "trained_tokens"):
        assert outs[0][key] == outs[1][key], key
    trained = [w.policy.lora_params + w.policy.value_params for w in workers]
    assert all(torch.equal(a, b) for a, b in zip(*trained))


def test_value_pretraining_continues_the_windows_from_their_cached_positions(warm_tiny, problems):
    """Issue 46 item 3: while the critic alone trains (algorithm.value_pretrain_steps) the policy does not move, so a
    response cut at a window continues next step from its cached positions instead of a prefill of its prompt and
    reply so far: fewer positions computed per trained token than once the policy moves (then every continuing
    response is prefilled again, on-policy)."""
    worker = RLWorker(tppo_config(warm_tiny, value_pretrain_steps=3), problems)
    history = [worker.step(step) for step in range(1, 7)]
    per_token = [aggregate([m])["positions_per_trained_token"] for m in history]
    critic_only, moving = per_token[1:3], per_token[4:]  # steps 2-3 continue step 1-2's windows; 5-6 follow updates
    assert history[0]["continuing"] > 0 and max(critic_only) == pytest.approx(1.0), per_token  # decode steps alone
    assert min(moving) > 2, per_token


def adamw_state(policy, params) -> list[tuple[int, float, float]]:
    """(step, sum |exp_avg|, sum |exp_avg_sq|) of each parameter's AdamW state (policy: a PolicyState)."""
    state = policy.optimizer.state
    return [
        (int(state[p]["step"]), float(state[p]["exp_avg"].abs().sum()), float(state[p]["exp_avg_sq"].abs().sum()))
        for p in params
    ]


def test_a_minibatch_of_cut_windows_steps_the_policy_and_leaves_the_critic_at_step_0(warm_tiny, problems):
    """T-PPO's first windows: every reply goes on past the window, so the policy trains on the window's tokens and the
    critic has no value target. AdamW steps the policy only: the critic's state stays as allocated (step 0, zero
    moments). Before: the critic stepped with a zero gradient, which advanced its bias correction (its first real
    update ~0.58x optim.value_lr)."""
    worker = RLWorker(tppo_config(warm_tiny), problems)
    torch.nn.init.normal_(
        worker.policy.critic.head.weight, std=0.3
    )  # values that differ along a reply: advantages != 0
    learner = worker.learner
    prompt = worker.encode_prompt(problems[0])
    cut = [PartialResponse(problems[0], prompt, [20 + i, 21, 22, 23], [0.0] * 4, window_start=0) for i in range(3)]
    tb = learner.batches.critic_batch([c.episode("window", 0.0, False, 0) for c in cut], worker.policy.critic)
    critic_before = {k: t.clone() for k, t in worker.policy.critic.trainable_tensors().items()}
    out = learner.update(worker.policy, tb)
    assert out["optimizer_steps"] == 1 and out["trained_tokens"] == 12
    policy = adamw_state(worker.policy, worker.policy.lora_params)
    assert all(step == 1 for step, _, _ in policy) and any(moments > 0 for _, moments, _ in policy)
    assert adamw_state(worker.policy, worker.policy.value_params) == [(0, 0.0, 0.0)] * len(worker.policy.value_params)
    assert all(torch.equal(t, critic_before[k]) for k, t in worker.policy.critic.trainable_tensors().items())


def test_a_minibatch_of_filtered_replies_leaves_the_policy_bit_for_bit(warm_tiny, problems):
    """PPO with DAPO's overlong filter: a minibatch whose replies were all cut at the token budget has value targets
    (the critic learns from them) but no policy token. After a normal step (the policy's AdamW has momentum), such a
    minibatch leaves every policy tensor bit for bit and its AdamW state as it was. Before: momentum and weight decay
    moved the policy."""
    config = parse_config(
        {
            "model": {"base": str(warm_tiny), "quant": {"routed_experts": "nf4"}},
            "lora": {"rank": 8, "alpha": 16},
            "rollout": {"prompts_per_step": 3, "group_size": 2, "max_new_tokens": MAX_NEW},
            "producer": {"kind": "windows"},
            "algorithm": {
                "advantage": "gae",
                "dynamic_sampling": False,
                "overlong": {"max_len": MAX_NEW, "cache_len": 4, "filter_truncated": True},
            },
            "optim": {"lr": 1e-3, "value_lr": 1e-2, "weight_decay": 0.1},
            "parallel": {"workers_per_node": 1},
        }
    )
    worker = RLWorker(config, problems)
    learner = worker.learner
    prompt = worker.encode_prompt(problems[0])

    def replies(reason: str, rewards: list[float]):
        return [
            PartialResponse(problems[0], prompt, [10 + i, 11, 12, 13, 14], [0.0] * 5, window_start=0).episode(
                reason, reward, reward > 0, 0
            )
            for i, reward in enumerate(rewards)
        ]

    normal = learner.update(
        worker.policy, learner.batches.critic_batch(replies("stop", [1.0, 0.0, 1.0]), worker.policy.critic)
    )
    assert normal["optimizer_steps"] == 1 and normal["trained_tokens"] > 0
    policy_before = {k: t.clone() for k, t in worker.adapter_tensors().items()}
    state_before = adamw_state(worker.policy, worker.policy.lora_params)
    critic_before = {k: t.clone() for k, t in worker.policy.critic.trainable_tensors().items()}
    worker.policy.version += 1  # as the worker counts its updates
    filtered = learner.update(
        worker.policy, learner.batches.critic_batch(replies("length", [0.0, 1.0, 0.0]), worker.policy.critic)
    )
    assert filtered["optimizer_steps"] == 1 and filtered["trained_tokens"] == 0  # the critic's step only
    assert all(torch.equal(t, policy_before[k]) for k, t in worker.adapter_tensors().items())
    assert adamw_state(worker.policy, worker.policy.lora_params) == state_before
    assert any(not torch.equal(t, critic_before[k]) for k, t in worker.policy.critic.trainable_tensors().items())


def test_a_critic_batch_refuses_episodes_of_several_segments(warm_tiny, problems):
    """critic_batch pairs each episode's reward with its row: an episode of two segments (multi-conversation, agents)
    would shift every later reward onto another row, so it is refused whatever producer made it."""
    from allsync.episodes import Episode

    worker = RLWorker(tppo_config(warm_tiny), problems)
    prompt = worker.encode_prompt(problems[0])
    one = PartialResponse(problems[0], prompt, [10, 11, 12], [0.0] * 3, window_start=0).episode("stop", 1.0, True, 0)
    two = Episode([one.final, one.final], 0.0, False)
    with pytest.raises(ValueError, match=r"algorithm\.advantage egae .* episode 1 of this batch has 2 segments"):
        worker.learner.batches.critic_batch([one, two, one], worker.policy.critic)


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"algorithm": {"advantage": "gae", "dynamic_sampling": False, "value_coef": 0.5}},
            r"'algorithm\.value_coef' was removed: .*optim\.value_lr",
        ),
        (
            {
                "producer": {"kind": "windows"},
                "algorithm": {"advantage": "gae", "dynamic_sampling": False},
                "optim": {"value_lr": 0.0},
            },
            r"optim\.value_lr = 0 with algorithm\.advantage gae: the critic would never learn",
        ),
    ],
)
def test_a_critic_that_cannot_learn_or_a_weight_that_does_nothing_is_refused(data, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(data, "x.yaml")
