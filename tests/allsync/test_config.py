"""Config files: unknown keys and impossible combinations are errors naming the key, before any work."""

import re

import pytest
import torch
import yaml

from allsync.config import ConfigError, RunConfig, load_config, load_config_for_planning, parse_config


def test_defaults_are_valid_and_nested_values_parse():
    c = parse_config(
        {"rollout": {"group_size": 4, "temperature": 0.9}, "algorithm": {"overlong": {"max_len": 16, "cache_len": 4}}}
    )
    assert isinstance(c, RunConfig)
    assert (c.rollout.group_size, c.rollout.temperature, c.algorithm.overlong.cache_len) == (4, 0.9, 4)
    assert c.model.quant.routed_experts == "nf4"


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"rollout": {"temprature": 1.0}},
            r"unknown key 'rollout\.temprature' \(did you mean rollout\.temperature\?\)",
        ),
        ({"optimiser": {}}, r"unknown key 'optimiser' \(did you mean optim\?\)"),
        ({"rollout": {"group_size": "eight"}}, r"'rollout\.group_size' = 'eight' is not of type"),
        ({"model": {"quant": {"routed_experts": "nf5"}}}, r"model\.quant\.routed_experts = 'nf5': unknown format"),
        ({"lora": {"targets": ["q_a_proj", "lm_head"]}}, r"lora\.targets: unknown target 'lm_head'"),
        (
            {"lora": {"expert_layout": "rank_shared"}},
            r"lora\.expert_layout = 'rank_shared': use per_expert or shared_outer",
        ),
        (
            {"lora": {"expert_layout": "shared_outer", "targets": ["q_a_proj"]}},
            r"lora\.expert_layout = shared_outer: lora\.targets has no routed_experts",
        ),
        (
            {"rollout": {"engine": "vllm"}, "lora": {"rank": 4}, "run": {"export": "merged"}},
            r"lora\.rank = 4 with rollout\.engine vllm",
        ),
        ({"lora": {"rank": 4}}, r"lora\.rank = 4 with run\.export peft"),
        ({"run": {"export": "gguf"}}, r"run\.export = .gguf."),
        (
            {"rollout": {"engine": "vllm"}, "lora": {"targets": ["kv_b_proj"]}, "run": {"export": "merged"}},
            r"kv_b_proj with rollout\.engine vllm",
        ),
        ({"lora": {"targets": ["kv_b_proj"]}}, r"kv_b_proj with run\.export peft"),
        ({"algorithm": {"advantage": "ppo2"}}, r"algorithm\.advantage: .*'ppo2'"),
        ({"algorithm": {"policy_loss": "nlft"}}, r"algorithm\.policy_loss nlft: NLFT trains on judged examples"),
        (
            {"algorithm": {"value_pretrain_steps": 5}},
            r"algorithm\.value_pretrain_steps / value_lam with algorithm\.advantage grpo",
        ),
        ({"algorithm": {"value_lam": 1.5}}, r"algorithm\.value_lam = 1\.5 must be in \[0, 1\]"),
        ({"algorithm": {"whiten": "scale"}}, r"algorithm\.whiten scale with algorithm\.advantage grpo"),
        ({"algorithm": {"whiten": "group"}}, r"algorithm\.whiten = 'group': use batch"),
        (
            {"algorithm": {"policy_loss": "gspo"}},
            r"algorithm\.policy_loss: unknown policy_loss 'gspo'; valid names: clipped",
        ),
        ({"rollout": {"group_size": 1}}, r"rollout\.group_size = 1 with algorithm\.advantage grpo"),
        ({"algorithm": {"advantage": "egae"}}, r"algorithm\.advantage egae learns a critic"),
        ({"algorithm": {"clip_c": 0.5}}, r"algorithm\.clip_c = 0\.5"),
        ({"parallel": {"layout": "disaggregated", "workers_per_node": 3}}, r"disaggregated needs an even number"),
        ({"optim": {"minibatches": 3}}, r"optim\.minibatches = 3 must divide"),
        (
            {"algorithm": {"overlong": {"max_len": 64, "cache_len": 8}}},
            r"overlong\.max_len = 64 exceeds rollout\.max_new_tokens = 16",
        ),
        ({"rollout": {"temperature": 0.0}}, r"rollout\.temperature = 0\.0: must be > 0"),
        ({"rollout": {"temperature": -1.0}}, r"rollout\.temperature = -1\.0: must be >= 0"),
        (
            {"rollout": {"top_p": 0.7}},
            r"rollout\.top_p = 0\.7: training samples from the full softmax.*run\.eval_top_p",
        ),
        ({"run": {"eval_top_p": 0.0}}, r"run\.eval_top_p = 0\.0: must be in \(0, 1\]"),
        ({"run": {"eval_top_p": 1.5}}, r"run\.eval_top_p = 1\.5"),
        ({"rollout": {"prompts_per_step": 0}}, r"rollout\.prompts_per_step = 0: must be >= 1"),
        ({"rollout": {"max_new_tokens": 0}}, r"rollout\.max_new_tokens = 0: must be >= 1"),
        ({"algorithm": {"max_sampling_rounds": 0}}, r"algorithm\.max_sampling_rounds = 0: must be >= 1"),
        ({"algorithm": {"filter_metric": "score"}}, r"algorithm\.filter_metric = 'score'"),
        ({"algorithm": {"on_sampling_cap": "drop"}}, r"algorithm\.on_sampling_cap = 'drop'"),
        ({"algorithm": {"kl_coef": -0.1}}, r"algorithm\.kl_coef = -0\.1: must be >= 0"),
        ({"run": {"eval_samples": 0}}, r"run\.eval_samples = 0: must be >= 1"),
        ({"run": {"keep_checkpoints": 0}}, r"run\.keep_checkpoints = 0: must be >= 1"),
        ({"lora": {"dropout": 0.1}}, r"lora\.dropout = 0\.1: RL trains on-policy"),
        ({"lora": {"dropout": 1.0}}, r"lora\.dropout = 1\.0"),
        ({"optim": {"betas": [0.9, 1.0]}}, r"optim\.betas = \[0\.9, 1\.0\]: each must be in \[0, 1\)"),
        ({"optim": {"value_lr": -1.0}}, r"optim\.value_lr"),
        ({"run": {"max_consecutive_nan": 0}}, r"run\.max_consecutive_nan = 0: must be >= 1"),
        ({"rollout": {"merge_lora": True}}, r"rollout\.merge_lora without model\.compute_copy"),
        ({"rollout": {"decode_batch": 0}}, r"rollout\.decode_batch = 0: must be >= 1"),
        ({"rollout": {"decode_batch": 32, "engine": "vllm"}}, r"rollout\.decode_batch = 32 with rollout\.engine vllm"),
        (
            {"rollout": {"kv_cache_tokens": 4096, "engine": "vllm"}},
            r"rollout\.kv_cache_tokens = 4096 with rollout\.engine vllm",
        ),
        ({"rollout": {"kv_cache_tokens": 1.5e5}}, r"'rollout\.kv_cache_tokens' = 150000\.0 is not of type int"),
        (
            {"rollout": {"kv_cache_tokens": 64, "max_new_tokens": 64}},
            r"rollout\.kv_cache_tokens = 64: must hold more than one row's rollout\.max_new_tokens \(64\)",
        ),
        (
            {"rollout": {"merge_lora": True, "engine": "vllm"}, "model": {"compute_copy": True}},
            r"rollout\.merge_lora with rollout\.engine vllm",
        ),
        (
            {"rollout": {"decode_graphs": True}, "parallel": {"device": "cpu"}},
            r"rollout\.decode_graphs with parallel\.device cpu: CUDA graphs need a GPU",
        ),
        (
            {"rollout": {"decode_graphs": True}, "model": {"compute_dtype": "bfloat16"}},
            r"rollout\.decode_graphs: no GPU is visible to torch on this machine",
        ),
        (
            {"rollout": {"decode_graphs": True, "engine": "vllm"}},
            r"rollout\.decode_graphs with rollout\.engine vllm",
        ),
        (
            {"rollout": {"decode_graphs": True}, "parallel": {"device": "cuda"}, "model": {"compute_dtype": "float32"}},
            r"rollout\.decode_graphs with model\.compute_dtype float32",
        ),
        # 4 prompts x 3 samples = 12 split into 4 minibatches globally, but each of the 2 workers holds 6
        (
            {"rollout": {"prompts_per_step": 4, "group_size": 3}, "optim": {"minibatches": 4}},
            r"must divide each worker's samples per step .* = 6\)",
        ),
    ],
)
def test_bad_configs_name_the_key(data, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(data, "x.yaml")


def test_load_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"missing\.yaml: config file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid YAML"):
        load_config(bad)


def test_shipped_configs_validate():
    from pathlib import Path

    configs = Path(__file__).parents[2] / "recipes" / "configs"
    big_path = configs / "dapo_math_deepseek_v3_671b.yaml"
    # the 671B plan (vLLM, EP 16) names no rollout.engine_expert_parallel: its two copies of the base taking turns are
    # not built, so it is refused by name
    with pytest.raises(ConfigError, match=r"expert_parallel = 16 with rollout.engine vllm"):
        load_config(big_path)
    big = parse_config(
        {
            **yaml.safe_load(big_path.read_text()),
            "rollout": {**yaml.safe_load(big_path.read_text())["rollout"], "engine": "torch"},
        }
    )
    assert big.parallel.workers == 48 and big.model.quant.routed_experts == "nf4"
    assert "kv_b_proj" not in big.lora.targets and big.lora.rank == 16 and big.parallel.expert_parallel == 16
    assert (
        big.task.name == "dataset"
        and big.reward.name == "math_dapo"
        and big.run.eval_samples == 32
        and big.run.eval_top_p == 0.7
    )
    memory_path = configs / "memory_agent_deepseek_v3_671b_48xh100.yaml"
    with pytest.raises(ConfigError, match=r"expert_parallel = 16 with rollout.engine vllm"):
        load_config(memory_path)
    memory = yaml.safe_load(memory_path.read_text())
    torch_engine = parse_config(
        {**memory, "rollout": {**memory["rollout"], "engine": "torch"}}
    )  # EP 16 + multiconv passes
    assert torch_engine.producer.credit == "all" and torch_engine.producer.chunk_tokens == 5000
    with pytest.raises(ConfigError, match=r"optim.balance_ranks with producer.kind multiconv"):
        parse_config(
            {
                **memory,
                "rollout": {**memory["rollout"], "engine": "torch"},
                "optim": {**memory["optim"], "balance_ranks": True},
            }
        )
    assert torch_engine.parallel.expert_parallel == 16 and torch_engine.lora.expert_kernel == "grouped_mm"
    # the torch-engine variant captures its decode steps as CUDA graphs: refused on a machine without a GPU, by name,
    # and accepted by everything else (what `allsync plan` checks)
    torch_path = configs / "dapo_math_deepseek_v3_671b_torch_engine.yaml"
    assert load_config_for_planning(torch_path)[1] is None
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"rollout.decode_graphs: no GPU is visible to torch on this machine"):
            load_config(torch_path)
    for path in configs.glob("*.yaml"):
        if path not in (big_path, memory_path, torch_path):
            load_config(path)


@pytest.mark.parametrize(
    "parallel, message",
    [
        ({"workers_per_node": 4, "expert_parallel": 3}, r"parallel.expert_parallel = 3 must divide the 4 workers"),
        (
            {"workers_per_node": 2, "tensor_parallel": 2},
            r"parallel.tensor_parallel = 2: the loop has no tensor parallelism",
        ),
        ({"device": "tpu"}, r"parallel.device = 'tpu': use auto, cpu or cuda"),
        ({"backend": "mpi"}, r"parallel.backend = 'mpi': use auto, gloo or nccl"),
        ({"device": "cpu", "backend": "nccl"}, r"parallel.backend = nccl with parallel.device cpu"),
        (
            {"workers_per_node": 2, "expert_parallel": 2, "layout": "disaggregated"},
            r"expert_parallel = 2 with parallel.layout disaggregated",
        ),
    ],
)
def test_bad_parallel_sections_name_the_key(parallel, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"parallel": parallel})


def test_cuda_without_a_gpu_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"parallel.device = cuda: no GPU is visible"):
        parse_config({"parallel": {"device": "cuda"}})
    assert parse_config({"parallel": {"device": "auto"}}).parallel.resolved_device() == "cpu"


def test_expert_parallel_must_divide_the_experts():
    from allsync.config import config_with_model_checks

    c = parse_config({"parallel": {"workers_per_node": 4, "expert_parallel": 4}, "rollout": {"prompts_per_step": 16}})
    config_with_model_checks(c, {"n_routed_experts": 256}, "x.yaml")
    with pytest.raises(ConfigError, match=r"expert_parallel = 4 does not divide the 6 routed experts"):
        config_with_model_checks(c, {"n_routed_experts": 6}, "x.yaml")


def test_length_reward_is_checked():
    from allsync.config import ConfigError, parse_config

    assert parse_config({"reward": {"length": {"coef": 0.5}}}).reward.length.coef == 0.5
    assert parse_config({"reward": {"length": {"groups": "with_correct"}}}).reward.length.groups == "with_correct"
    with pytest.raises(ConfigError, match=r"reward.length.groups = 'some': use one of all, with_correct"):
        parse_config({"reward": {"length": {"groups": "some"}}})
    with pytest.raises(ConfigError, match=r"reward.length.coef = 0: must be > 0"):
        parse_config({"reward": {"length": {"coef": 0}}})
    with pytest.raises(ConfigError, match=r"reward.length with algorithm.advantage egae"):
        parse_config(
            {
                "reward": {"length": {}},
                "algorithm": {"advantage": "egae", "dynamic_sampling": False},
                "producer": {"kind": "windows", "window": 4},
            }
        )


def test_a_compute_copy_larger_than_half_the_free_memory_is_refused(tiny_bf16, monkeypatch):
    """model.compute_copy is refused before the copies are made when they would take more than half of the
    device's free memory, naming the key."""
    import allsync.run.engine_link as engine_link
    from allsync.run.worker import RLWorker
    from allsync.config import ConfigError
    from allsync.tasks import Problem

    config = parse_config(
        {
            "model": {"base": str(tiny_bf16), "compute_copy": True},
            "run": {"export": "merged"},
            "lora": {"rank": 4},
            "parallel": {"workers_per_node": 1},
        }
    )
    monkeypatch.setattr(engine_link, "free_device_bytes", lambda device: 1_000_000)
    with pytest.raises(ConfigError, match="model.compute_copy: a torch.float32 copy of the frozen weights needs"):
        RLWorker(config, [Problem("1+1", "2")])


def float_settings() -> list[tuple[dict, str]]:
    """(the smallest config data that sets it, its dotted key) for every float setting of every section, the task's
    and producer's of every registered class included, found by walking the dataclasses."""
    import dataclasses
    import typing

    from allsync.config.parsing import _dataclass_of, _holds_float
    from allsync.producers.registry import ProducerSettings, producer_classes
    from allsync.tasks import TASKS, TaskSettings

    out = []

    def walk(cls, path: list[str], named: dict):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            annotation = hints[f.name]
            if annotation is TaskSettings:
                for name, task in TASKS.items():
                    walk(task, path + [f.name], {"name": name})
            elif annotation is ProducerSettings:
                for kind, producer in producer_classes().items():
                    walk(producer, path + [f.name], {"kind": kind})
            elif _dataclass_of(annotation) is not None:
                walk(_dataclass_of(annotation), path + [f.name], {})
            elif _holds_float(annotation) and f.init:
                out.append((path + [f.name], named, typing.get_origin(annotation) is list))

    walk(RunConfig, [], {})
    settings = []
    for path, named, is_list in out:
        for bad in (float("nan"), float("inf"), -1.0):
            data = leaf = {}
            for part in path[:-1]:
                leaf[part] = {}
                leaf = leaf[part]
            if len(path) == 2 and path[0] in ("task", "producer"):
                leaf.update(named)
            leaf[path[-1]] = [bad, 0.5] if is_list else bad
            settings.append((data, ".".join(path)))
    return settings


FLOAT_SETTINGS = float_settings()


def test_every_float_setting_is_walked():
    keys = {key for _, key in FLOAT_SETTINGS}
    assert {
        "optim.lr",
        "optim.value_lr",
        "algorithm.kl_coef",
        "algorithm.overlong.factor",
        "optim.betas",
        "reward.length.coef",
        "health.min_z",
    } <= keys
    assert any(key.startswith("task.") for key in keys) and any(key.startswith("producer.") for key in keys)


@pytest.mark.parametrize("data, key", FLOAT_SETTINGS, ids=[f"{k}={d}" for d, k in FLOAT_SETTINGS])
def test_nan_inf_and_negative_floats_are_refused_naming_the_key(data, key):
    with pytest.raises(ConfigError, match=re.escape(f"{key} = ") + ".*must be (a finite number|>= 0)"):
        parse_config(data)


def test_nan_from_yaml_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: .nan\n")
    with pytest.raises(ConfigError, match=r"optim\.lr = nan: must be a finite number"):
        load_config(path)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"rollout": {"engine_expert_parallel": True}},
            r"rollout\.engine_expert_parallel / engine_tensor_parallel with rollout\.engine torch",
        ),
        (
            {"rollout": {"engine": "vllm", "engine_tensor_parallel": 2}},
            r"rollout\.engine_tensor_parallel = 2 without rollout\.engine_expert_parallel",
        ),
        (
            {"rollout": {"engine": "vllm"}, "parallel": {"expert_parallel": 2}},
            r"parallel\.expert_parallel = 2 with rollout\.engine vllm and no rollout\.engine_expert_parallel",
        ),
        (
            {
                "rollout": {"engine": "vllm", "engine_expert_parallel": True},
                "parallel": {"workers_per_node": 1},
                "optim": {"minibatches": 1},
            },
            r"rollout\.engine_expert_parallel with 1 worker\(s\)",
        ),
        (
            {
                "rollout": {
                    "engine": "vllm",
                    "engine_expert_parallel": True,
                    "engine_tensor_parallel": 4,
                    "prompts_per_step": 6,
                },
                "parallel": {"workers_per_node": 6},
            },
            r"rollout\.engine_tensor_parallel = 4 does not divide the 6 workers",
        ),
    ],
)
def test_the_engine_layout_is_refused_naming_the_key(data, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(data, "x.yaml")


def test_an_engine_over_the_workers_needs_an_expert_for_each_and_a_launcher(monkeypatch):
    """What the checkpoint must allow (every worker a block of its routed experts: 3 over 2 split 2 and 1, as vLLM
    places them; 1 over 2 leaves a worker none), where it is launched
    (torchrun / accelerate launch, not Ray or one in-process worker), and vLLM's Triton LoRA kernels' dtypes
    (linear layers: float16 / bfloat16 only), each refused naming the key before anything is built."""
    from allsync.config import config_with_model_checks
    from allsync.engines import vllm_support
    from allsync.launch.local import LocalGroup
    from allsync.launch.ray_actors import RayGroup

    monkeypatch.setattr(vllm_support, "triton_lora_kernels", lambda: True)  # a GPU, or the CPU harness
    moe = {"n_routed_experts": 4, "num_hidden_layers": 2, "first_k_dense_replace": 1}
    rollout = {"engine": "vllm", "engine_expert_parallel": True}
    c = parse_config({"rollout": rollout, "lora": {"targets": ["routed_experts"]}})
    config_with_model_checks(c, moe, "x.yaml")
    config_with_model_checks(c, {**moe, "n_routed_experts": 3}, "x.yaml")
    with pytest.raises(ConfigError, match=r"its 1 routed experts must give each of the 2 workers one at least"):
        config_with_model_checks(c, {**moe, "n_routed_experts": 1}, "x.yaml")
    with pytest.raises(ConfigError, match=r"\(it has no MoE layer\)"):
        config_with_model_checks(c, {**moe, "first_k_dense_replace": 2}, "x.yaml")
    with pytest.raises(ConfigError, match=r"lora\.targets \['o_proj'\] with model\.compute_dtype float32"):
        config_with_model_checks(
            parse_config({"rollout": rollout, "lora": {"targets": ["o_proj", "routed_experts"]}}), moe, "x.yaml"
        )
    tp2 = parse_config({"rollout": {**rollout, "engine_tensor_parallel": 2}, "lora": {"targets": ["routed_experts"]}})
    with pytest.raises(ConfigError, match=r"rollout\.engine_tensor_parallel = 2 does not divide the 3 attention heads"):
        config_with_model_checks(tp2, {**moe, "num_attention_heads": 3}, "x.yaml")
    assert "rollout.engine_expert_parallel under Ray" in RayGroup.refusal(c, False, None)
    assert "rollout.engine_expert_parallel with --no-ray" in LocalGroup.refusal(c, True, None)


def test_vllm_target_modules_name_what_vllm_matches():
    from allsync.engines.vllm_support import vllm_target_modules

    assert vllm_target_modules(["q_a_proj", "kv_a_proj_with_mqa", "shared_experts", "routed_experts"]) == [
        "down_proj",
        "experts",
        "gate_proj",
        "kv_a_proj_with_mqa",
        "q_a_proj",
        "up_proj",
    ]
