"""rollout.engine_formats: the torch engine generates with a second frozen copy in other formats whose LoRA tensors
are the trainer's own parameters, a sampler that is not the trainer (as vLLM serving FP8 beside an NF4 trainer)."""

import pytest

from allsync.config import ConfigError, parse_config
from allsync.metrics import aggregate
from allsync.tasks import Problem
from allsync.run.worker import RLWorker

PROBLEMS = [Problem(f"what is {a}+{b}?", str(a + b)) for a in range(10) for b in range(10)]


def config(base, engine_formats=None, **extra):
    return parse_config(
        {
            "model": {"base": str(base), "quant": {"routed_experts": "nf4"}},
            "lora": {"rank": 8, "alpha": 16},
            "rollout": {"prompts_per_step": 4, "group_size": 2, "max_new_tokens": 6, "engine_formats": engine_formats},
            "algorithm": {"dynamic_sampling": False},
            "optim": {"lr": 1e-2},
            "parallel": {"workers_per_node": 1},
            **extra,
        }
    )


def test_the_engines_copy_shares_the_trainers_lora_and_samples_from_its_own_formats(tiny_bf16):
    same = RLWorker(config(tiny_bf16, {"routed_experts": "nf4"}), PROBLEMS)  # a copy in the trainer's formats
    other = RLWorker(config(tiny_bf16, {"routed_experts": "bf16"}), PROBLEMS)
    for worker in (same, other):
        engine_model = worker.engine.model
        assert engine_model is not worker.model
        trainer = dict(worker.model.named_parameters())
        shared = [n for n, p in engine_model.named_parameters() if p.requires_grad]
        assert shared and all(engine_model.get_parameter(n) is trainer[n] for n in shared)
    gaps = {}
    for name, worker in (("same", same), ("other", other)):
        gaps[name] = [aggregate([worker.step(step)])["logprob_gap"] for step in (1, 2, 3)]
    # the copy in the trainer's formats samples the trainer's policy after every update (the LoRA is shared);
    # bf16 experts against the trainer's NF4 ones do not
    assert max(gaps["same"]) < 1e-4, gaps
    assert min(gaps["other"]) > 10 * max(gaps["same"]), gaps


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"engine_formats": {"routed_experts": "fp4"}}, r"rollout.engine_formats.routed_experts = 'fp4'"),
        ({"engine_formats": {"experts": "bf16"}}, r"rollout.engine_formats.experts = 'bf16'"),
    ],
)
def test_engine_formats_are_checked_naming_the_key(tiny_bf16, changes, message):
    with pytest.raises(ConfigError, match=message):
        config(tiny_bf16, **changes)


def test_engine_formats_need_the_torch_engine_without_expert_parallelism(tiny_bf16):
    with pytest.raises(
        ConfigError, match=r"rollout.engine_formats with rollout.engine torch and parallel.expert_parallel 2"
    ):
        parse_config(
            {
                "model": {"base": str(tiny_bf16)},
                "rollout": {"prompts_per_step": 4, "group_size": 2, "engine_formats": {"routed_experts": "bf16"}},
                "parallel": {"workers_per_node": 2, "expert_parallel": 2},
            }
        )
