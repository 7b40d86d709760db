"""`allsync make-tiny`: DeepSeek-V3's exact on-disk layout, tokenizer, atomic output."""

import json

import pytest
import torch
from safetensors import safe_open

from allsync.cli import main as cli_main
from moe_lora import tiny as tiny_module
from moe_lora.tiny import SPECIAL_TOKENS, TinySpec, make_tiny
from quant.checkpoint_io import INDEX_NAME
from quant.layout import expected_tensors, fp8_scale_shape, scale_key


def _all_tensors(path):
    index = json.loads((path / INDEX_NAME).read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return index, out


def test_config_is_deepseek_v3s(tiny_bf16):
    config = json.loads((tiny_bf16 / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (config["topk_method"], config["scoring_func"]) == ("noaux_tc", "sigmoid")
    assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (512, 64)
    assert config["first_k_dense_replace"] == 1 and config["n_routed_experts"] == 8
    assert "quantization_config" not in config


def test_bf16_layout_sharded_with_per_expert_keys(tiny_bf16):
    index, tensors = _all_tensors(tiny_bf16)
    config = json.loads((tiny_bf16 / "config.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert set(index["weight_map"]) == set(tensors) == set(expected_tensors(config))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert tensors["model.layers.2.mlp.experts.7.down_proj.weight"].shape == (128, 64)
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert tensors["model.layers.0.mlp.gate_proj.weight"].dtype == torch.bfloat16  # dense layer
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" not in tensors


def test_fp8_layout_block_scales(tiny_fp8, tiny_bf16):
    config = json.loads((tiny_fp8 / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    }
    _, tensors = _all_tensors(tiny_fp8)
    _, bf16 = _all_tensors(tiny_bf16)
    for key, spec in expected_tensors(config).items():
        if spec.quantizable:
            assert tensors[key].dtype == torch.float8_e4m3fn, key
            assert tuple(tensors[scale_key(key)].shape) == fp8_scale_shape(spec.shape)
            assert tensors[scale_key(key)].dtype == torch.float32
        else:  # norms, router, embeddings, lm_head stay as V3 keeps them
            assert tensors[key].dtype == bf16[key].dtype and torch.equal(tensors[key], bf16[key]), key
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # [576, 128]: a partial 5th row of blocks
    assert tensors[scale_key(kv_a)].shape == (5, 1)


def test_a_bf16_checkpoint_rewritten_in_fp8_is_the_fp8_checkpoint(tiny_fp8, tiny_bf16, tmp_path):
    """write_fp8_copy (a warm-started bf16 base in the release's format) gives what make-tiny writes with fp8 from
    the same weights: every tensor equal, the same config, the tokenizer beside it; an FP8 source is refused."""
    copy = tiny_module.write_fp8_copy(tiny_bf16, tmp_path / "copy")
    _, got = _all_tensors(copy)
    _, want = _all_tensors(tiny_fp8)
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key].float(), want[key].float()), key
    assert json.loads((copy / "config.json").read_text()) == json.loads((tiny_fp8 / "config.json").read_text())
    assert (copy / "tokenizer.json").read_bytes() == (tiny_bf16 / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match=r"copy/config.json: already quantized \(fp8\)"):
        tiny_module.write_fp8_copy(copy, tmp_path / "again")
    assert not (tmp_path / "again").exists()


def test_tokenizer_covers_task_text_and_special_tokens(tiny_bf16):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_bf16)
    text = "what is 12*(3+4)-5/6? answer: 79 ^ = % ."
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id == 0 and tok.eos_token_id == 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    for special in SPECIAL_TOKENS:
        assert len(tok(special, add_special_tokens=False).input_ids) == 1, special
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], tokenize=False
    )
    assert chat == "<｜begin▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜>4<｜end▁of▁sentence｜>"
    assert len(tok) == json.loads((tiny_bf16 / "config.json").read_text())["vocab_size"]


def test_failure_leaves_no_output(tmp_path, monkeypatch):
    def broken_write(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(tiny_module, "write_shards", broken_write)
    with pytest.raises(OSError, match="disk full"):
        make_tiny(tmp_path / "out")
    assert list(tmp_path.iterdir()) == []  # neither OUT nor a temporary directory is left


def test_existing_output_is_not_touched(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert cli_main(["make-tiny", str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_invalid_spec_is_rejected_before_writing(tmp_path):
    with pytest.raises(ValueError, match="--dense-layers 5 must be between 0 and --layers 3"):
        make_tiny(tmp_path / "out", TinySpec(dense_layers=5))
    assert not (tmp_path / "out").exists()


def test_cli_options_shape_the_checkpoint(tmp_path):
    assert (
        cli_main(
            ["make-tiny", str(tmp_path / "c"), "--layers", "2", "--experts", "4", "--dense-layers", "0", "--seed", "3"]
        )
        == 0
    )
    config = json.loads((tmp_path / "c" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["n_routed_experts"], config["first_k_dense_replace"]) == (2, 4, 0)
    _, a = _all_tensors(tmp_path / "c")
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in a
