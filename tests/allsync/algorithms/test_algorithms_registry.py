from types import SimpleNamespace

import pytest
import torch

import allsync.algorithms as alg
from allsync.algorithms import REGISTRIES, UnknownNameError, get


def test_lookup_by_name():
    assert get("advantage", "grpo").compute is alg.grpo_advantages
    assert get("advantage", "drgrpo").compute is alg.drgrpo_advantages
    assert get("advantage", "gae").compute is alg.gae
    assert get("advantage", "egae").compute is alg.egae
    assert get("policy_loss", "clipped").compute is alg.clipped_policy_loss
    assert get("kl", "k3") is alg.kl_k3
    assert get("reward_shaping", "overlong") is alg.shape_overlong
    assert get("reward_shaping", "length") is alg.shape_length
    assert set(REGISTRIES["loss_aggregation"]) == {
        "token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum-norm",
        "episode-mean-token-mean",
    }


def test_unknown_name_raises_naming_it_and_listing_valid_ones():
    with pytest.raises(ValueError, match=r"'ppo2'.*drgrpo, egae, gae, grpo") as info:
        get("advantage", "ppo2")
    assert isinstance(info.value, UnknownNameError) and info.value.name == "ppo2"
    with pytest.raises(ValueError, match="'loss'.*advantage"):
        get("loss", "token-mean")


def test_every_public_name_is_exported():
    for name in alg.__all__:
        assert hasattr(alg, name), name


def test_estimators_say_what_they_need():
    needs = {name: (e.needs_groups, e.needs_critic, e.bootstraps_cut) for name, e in alg.ADVANTAGE_ESTIMATORS.items()}
    assert needs == {
        "grpo": (True, False, False),
        "drgrpo": (True, False, False),
        "reinforce_pp_baseline": (True, False, False),
        "gae": (False, True, False),
        "egae": (False, True, True),
    }
    rewards, groups = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    assert torch.equal(get("advantage", "drgrpo")(rewards, groups), torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_refusals_name_the_estimators_the_registry_holds(tiny_bf16, monkeypatch):
    """A hint lists what the registry holds, never a hand-kept list: an estimator a contributor registers appears in
    the refusals that call for its kind (issue 50)."""
    from allsync.config import ConfigError, parse_config

    assert alg.estimators_that(needs_groups=True) == "grpo or drgrpo or reinforce_pp_baseline"
    assert alg.estimators_that(needs_critic=True, bootstraps_cut=False) == "gae"
    rloo = alg.AdvantageEstimator(alg.grpo_advantages, needs_groups=True, needs_critic=False)
    monkeypatch.setitem(alg.ADVANTAGE_ESTIMATORS, "rloo", rloo)
    with pytest.raises(ConfigError, match=r"group baselines \(grpo or drgrpo or reinforce_pp_baseline or rloo\)"):
        parse_config(
            {
                "model": {"base": str(tiny_bf16)},
                "algorithm": {"advantage": "gae", "dynamic_sampling": True},
                "producer": {"kind": "windows"},
            }
        )


def test_shapers_add_the_formulas_of_their_settings():
    lengths, correct, groups = (
        torch.tensor([10, 14, 16, 20]),
        torch.tensor([True, True, False, True]),
        torch.tensor([0, 0, 1, 1]),
    )
    overlong = get("reward_shaping", "overlong")(
        lengths, correct, groups, SimpleNamespace(max_len=16, cache_len=4, factor=1.0)
    )
    assert overlong.dtype == torch.float64 and overlong.tolist() == [
        0.0,
        -0.5,
        -1.0,
        -1.0,
    ]  # 12 tokens free, -1 past 16
    length = get("reward_shaping", "length")(lengths, correct, groups, SimpleNamespace(coef=0.2, groups="all"))
    assert length.tolist() == pytest.approx(
        [0.1, -0.1, 0.0, -0.1]
    )  # 0.2 x (+0.5 shortest, -0.5 longest; wrong: min(0, .))
    all_wrong = torch.tensor([False, False, False, True])  # group 0 has no correct reply
    for which, expected in (("all", [0.0, -0.1, 0.0, -0.1]), ("with_correct", [0.0, 0.0, 0.0, -0.1])):
        settings = SimpleNamespace(coef=0.2, groups=which)
        shaped = get("reward_shaping", "length")(lengths, all_wrong, groups, settings)
        assert shaped.tolist() == pytest.approx(expected), which


def test_a_name_registered_twice_is_refused_naming_both_modules(monkeypatch):
    """An extension registered as `grpo` (or any name a registry holds) would replace the built-in for every run that
    imports it: refused, as tasks and producers are; a new name registers."""
    for kind, table in REGISTRIES.items():
        name = next(iter(table))
        before = table[name]
        with pytest.raises(ValueError, match=rf"{kind} {name!r} is registered twice \(allsync\.algorithms\.\w+ and"):
            table[name] = before
        assert table[name] is before
    monkeypatch.setitem(alg.ADVANTAGE_ESTIMATORS, "mine", alg.ADVANTAGE_ESTIMATORS["grpo"])
    assert get("advantage", "mine") is alg.ADVANTAGE_ESTIMATORS["grpo"]


def test_a_loss_checks_the_clip_settings_it_reads_and_refuses_the_ones_it_ignores(tiny_bf16, monkeypatch):
    """PolicyLossEntry.reads: a loss with no lower clip (CISPO's shape) takes any clip_high and refuses a clip_low or
    clip_c it would ignore; the clipped loss checks all three ranges."""
    from allsync.config import ConfigError, parse_config

    cispo = alg.PolicyLossEntry(alg.clipped_policy_loss, logged=(), reads=("clip_high",))
    monkeypatch.setitem(alg.POLICY_LOSSES, "upper_only", cispo)

    def parse(**algorithm):
        return parse_config({"model": {"base": str(tiny_bf16)}, "algorithm": algorithm})

    assert parse(policy_loss="upper_only", clip_high=5.0).algorithm.clip_high == 5.0
    for key, value in (("clip_low", 0.5), ("clip_c", 3.0)):
        with pytest.raises(
            ConfigError,
            match=rf"algorithm\.{key} = {value} with algorithm\.policy_loss upper_only: "
            r"the loss does not read it \(it reads algorithm\.clip_high\)",
        ):
            parse(policy_loss="upper_only", **{key: value})
    for key, value, message in (
        ("clip_low", 1.0, r"algorithm\.clip_low = 1\.0: must be in \(0, 1\)"),
        ("clip_high", 0.0, r"algorithm\.clip_high = 0\.0: must be > 0"),
        ("clip_c", 1.0, r"algorithm\.clip_c = 1\.0: the dual clip constant must be > 1"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse(**{key: value})
    with pytest.raises(ValueError, match=r"PolicyLossEntry\.reads: \['clip_mid'\] are not clip settings"):
        alg.PolicyLossEntry(alg.clipped_policy_loss, logged=(), reads=("clip_mid",))
