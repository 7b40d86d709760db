"""The TRL side of benchmarks/trl_side_by_side.py gets what allsync's default run gets: the same LoRA modules, prompt
ids and reward (the benchmark itself trains for minutes; these are its set-up, checked without training)."""

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from allsync.tasks import Problem, encode_prompt
from benchmarks.trl_side_by_side import default_config, peft_model, shaped_reward, trl_grpo_config, trl_prompts
from quant.checkpoint_io import read_config


def test_peft_adapts_every_module_allsync_adapts_once(tiny_bf16):
    config = default_config()
    model = peft_model(AutoModelForCausalLM.from_pretrained(tiny_bf16, dtype=torch.float32), config)
    base = read_config(tiny_bf16)
    shapes = {
        name.removeprefix("base_model.model.").replace(".default", ""): tuple(p.shape)
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    r, experts = config.lora.rank, base["n_routed_experts"]
    wanted = {}
    for layer in range(base["num_hidden_layers"]):
        for proj in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
            wanted[f"model.layers.{layer}.self_attn.{proj}.lora_A.weight"] = r
        mlp = "mlp" if layer < base["first_k_dense_replace"] else "mlp.shared_experts"
        for proj in ("gate_proj", "up_proj", "down_proj"):
            wanted[f"model.layers.{layer}.{mlp}.{proj}.lora_A.weight"] = r
        if layer >= base["first_k_dense_replace"]:  # gate_up wrapped first (base_layer), then down: rank r per expert
            wanted[f"model.layers.{layer}.mlp.experts.base_layer.lora_A.weight"] = experts * r
            wanted[f"model.layers.{layer}.mlp.experts.lora_A.weight"] = experts * r
    assert {k: v[0] for k, v in shapes.items() if ".lora_A." in k} == wanted
    assert shapes["model.layers.2.mlp.experts.base_layer.lora_B.weight"] == (
        2 * base["moe_intermediate_size"],
        experts * r,
    )


def test_trl_sees_allsync_prompt_ids(tiny_bf16):
    tokenizer = AutoTokenizer.from_pretrained(tiny_bf16)
    problems = [Problem("What is 34+68?", "102"), Problem("What is 9+90?", "99")]
    for text, problem in zip(trl_prompts(tokenizer, problems), problems):
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == encode_prompt(tokenizer, problem)


def test_reward_is_the_default_runs_score_plus_overlong_shaping():
    config = default_config()  # overlong: max_len 16, cache_len 4 -> 0 up to 12 tokens, -(L - 12) / 4 beyond
    rewards = shaped_reward(
        config, ["Answer: 102", "Answer: 7", "Answer: 102"], [[0] * 12, [0] * 15, [0] * 16], ["102", "102", "102"]
    )
    assert rewards == [1.0, -0.75, 0.0]


def test_trl_config_is_the_default_runs():
    config = default_config()
    trl = trl_grpo_config(config, "unused", threads=2)
    r = config.rollout
    assert trl.generation_batch_size // trl.num_generations == r.prompts_per_step
    assert (trl.num_generations, trl.max_completion_length, trl.learning_rate) == (
        r.group_size,
        r.max_new_tokens,
        config.optim.lr,
    )
    assert (trl.epsilon, trl.epsilon_high, trl.beta, trl.loss_type) == (0.2, 0.28, 0.0, "dapo")
    assert (trl.adam_beta2, trl.max_grad_norm, trl.bf16) == (config.optim.betas[1], config.optim.grad_clip, False)
