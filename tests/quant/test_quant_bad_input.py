"""Bad checkpoints and settings fail before any loading, with the file and tensor named."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import quant.loader as loader_module
from quant.checkpoint_io import INDEX_NAME, CheckpointError
from quant.loader import QuantPlan, load_frozen_model


@pytest.fixture
def ckpt(tiny_bf16, tmp_path):
    return shutil.copytree(tiny_bf16, tmp_path / "ckpt")


@pytest.fixture
def fp8_ckpt(tiny_fp8, tmp_path):
    return shutil.copytree(tiny_fp8, tmp_path / "ckpt-fp8")


@pytest.fixture
def nothing_built(monkeypatch):
    """Fails the test if the loader gets as far as building the model."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the model was built before the checkpoint was validated")

    monkeypatch.setattr(loader_module, "build_skeleton", forbidden)


def _index(path):
    return json.loads((path / INDEX_NAME).read_text())


def _write_json(path, data):
    path.write_text(json.dumps(data))


def _rewrite_tensor(ckpt, key, fn):
    shard = ckpt / _index(ckpt)["weight_map"][key]
    tensors = load_file(shard)
    tensors[key] = fn(tensors[key])
    save_file(tensors, shard)
    return shard


def test_missing_shard(ckpt, nothing_built):
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"model-00002-of-00002\.safetensors: shard file missing .*model\.layers\.\d+"
    ):
        load_frozen_model(ckpt, progress=False)


def test_index_names_a_tensor_its_shard_lacks(ckpt, nothing_built):
    index = _index(ckpt)
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    wrong = (
        "model-00001-of-00002.safetensors"
        if index["weight_map"][key].startswith("model-00002")
        else "model-00002-of-00002.safetensors"
    )
    index["weight_map"][key] = wrong
    _write_json(ckpt / INDEX_NAME, index)
    with pytest.raises(
        CheckpointError, match=rf"{wrong}: the index says tensor '{key}' is in this shard, but it is not"
    ):
        load_frozen_model(ckpt, progress=False)


def test_index_without_a_tensor_the_config_needs(ckpt, nothing_built):
    index = _index(ckpt)
    del index["weight_map"]["model.layers.2.mlp.gate.e_score_correction_bias"]
    _write_json(ckpt / INDEX_NAME, index)
    with pytest.raises(
        CheckpointError, match=r"names no shard for 1 tensor.*model\.layers\.2\.mlp\.gate\.e_score_correction_bias"
    ):
        load_frozen_model(ckpt, progress=False)


def test_shape_disagrees_with_config(ckpt, nothing_built):
    key = "model.layers.2.mlp.experts.5.down_proj.weight"
    shard = _rewrite_tensor(ckpt, key, lambda t: t[:, :32].contiguous())
    with pytest.raises(
        CheckpointError, match=rf"{shard.name}: tensor '{key}' has shape \[128, 32\], config.json implies \[128, 64\]"
    ):
        load_frozen_model(ckpt, progress=False)


def test_more_experts_on_disk_than_config_says(ckpt, nothing_built):
    config = json.loads((ckpt / "config.json").read_text())
    config["n_routed_experts"] = 4
    _write_json(ckpt / "config.json", config)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.layers\.\d\.mlp\.(experts\.[4-7]|gate)\..*"):
        load_frozen_model(ckpt, progress=False)


def test_dtype_disagrees(ckpt, nothing_built):
    key = "model.layers.0.input_layernorm.weight"
    _rewrite_tensor(ckpt, key, lambda t: t.to(torch.int8))
    with pytest.raises(CheckpointError, match=rf"tensor '{key}' has dtype I8, expected BF16 or F16 or F32"):
        load_frozen_model(ckpt, progress=False)


def test_fp8_weight_in_a_checkpoint_that_does_not_say_fp8(ckpt, nothing_built):
    key = "model.layers.0.self_attn.o_proj.weight"
    _rewrite_tensor(ckpt, key, lambda t: t.to(torch.float8_e4m3fn))
    with pytest.raises(CheckpointError, match=rf"tensor '{key}' has dtype F8_E4M3"):
        load_frozen_model(ckpt, progress=False)


def test_block_size_other_than_128(fp8_ckpt, nothing_built):
    config = json.loads((fp8_ckpt / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    _write_json(fp8_ckpt / "config.json", config)
    with pytest.raises(
        CheckpointError, match=r"config\.json: quantization_config\.weight_block_size is \[64, 64\], only \[128, 128\]"
    ):
        load_frozen_model(fp8_ckpt, progress=False)


def test_scale_with_wrong_block_grid(fp8_ckpt, nothing_built):
    key = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"
    _rewrite_tensor(fp8_ckpt, key, lambda t: t[:4].contiguous())
    with pytest.raises(CheckpointError, match=rf"tensor '{key}' has shape \[4, 1\], 128x128 blocks imply \[5, 1\]"):
        load_frozen_model(fp8_ckpt, progress=False)


def test_unknown_format_name():
    with pytest.raises(ValueError, match=r"unknown quantization format 'nf3' for quant\.attention"):
        QuantPlan(attention="nf3")


def test_not_a_deepseek_v3_config(ckpt, nothing_built):
    config = json.loads((ckpt / "config.json").read_text())
    config["model_type"] = "llama"
    _write_json(ckpt / "config.json", config)
    with pytest.raises(CheckpointError, match=r"config\.json: model_type is 'llama', expected 'deepseek_v3'"):
        load_frozen_model(ckpt, progress=False)
