"""allsync.warm_start: training batches, DeepSeek-V3 on-disk format, reload through quant's loader, caching."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from allsync import warm_start as ws
from allsync.tasks import ArithmeticGenerator, Problem, answer_examples
from allsync.warm_start import (
    DEFAULT_SPEC,
    EvalSettings,
    TrainSettings,
    WarmStartSettings,
    collate,
    lr_at,
    save_checkpoint,
    to_disk_tensors,
    train_and_evaluate,
    warm_start,
)
from moe_lora.tiny import build_tokenizer, make_tiny, tiny_config
from quant.checkpoint_io import INDEX_NAME, atomic_output_dir
from quant.layout import expected_tensors
from quant.loader import QuantPlan, load_frozen_model

FAST = WarmStartSettings(
    task=ArithmeticGenerator(1, 2),
    steps=4,
    seed=0,
    train=TrainSettings(batch_size=8, warmup_steps=2),
    eval=EvalSettings(heldout_size=6, samples_per_problem=2, max_new_tokens=6),
)


def _disk_tensors(path):
    index = json.loads((path / INDEX_NAME).read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return index, out


def test_training_example_labels_only_the_answer():
    tok = build_tokenizer()
    (ids, start), (ids2, start2) = answer_examples(tok, [Problem("What is 1+2?", "3"), Problem("What is 10+20?", "30")])
    assert (
        tok.decode(ids) == "<｜begin▁of▁sentence｜><｜User｜>What is 1+2?<｜Assistant｜>Answer: 3<｜end▁of▁sentence｜>"
    )
    assert tok.decode(ids[start:]) == "Answer: 3<｜end▁of▁sentence｜>" and len(ids) - start == 10
    batch = collate([(ids, start), (ids2, start2)], pad_id=tok.pad_token_id)
    assert batch["input_ids"].shape == (2, len(ids2)) and len(ids2) == len(ids) + 3
    assert batch["labels"][0, :start].eq(-100).all() and batch["labels"][0, len(ids) :].eq(-100).all()
    assert batch["labels"][0, start : len(ids)].tolist() == ids[start:]
    assert batch["attention_mask"].sum(1).tolist() == [len(ids), len(ids2)]


def test_lr_schedule():
    assert lr_at(0, 100, 1.0, 10) == pytest.approx(0.1)  # warm-up 1/10, cosine ~1
    assert lr_at(9, 100, 1.0, 10) == pytest.approx(
        0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(0.09 * torch.pi)).item())
    )
    assert lr_at(50, 100, 1.0, 10) == pytest.approx(0.55)  # halfway: 0.1 + 0.9 * 0.5
    assert lr_at(100, 100, 1.0, 10) == pytest.approx(0.1)  # ends at 10%


def test_to_disk_tensors_inverts_transformers_fusing(tmp_path):
    """A make_tiny checkpoint loaded by transformers (experts fused) maps back to its exact on-disk tensors."""
    from transformers import AutoModelForCausalLM

    path = make_tiny(tmp_path / "tiny", DEFAULT_SPEC)
    config = json.loads((path / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape == (4, 256, 128)  # [E, 2I, H]
    disk = to_disk_tensors(model.state_dict(), config)
    _, original = _disk_tensors(path)
    assert list(disk) == list(expected_tensors(config))
    for key, t in original.items():
        assert disk[key].dtype == t.dtype and torch.equal(disk[key], t), key


def test_to_disk_tensors_rejects_a_foreign_state_dict():
    config = tiny_config(DEFAULT_SPEC, vocab_size=265)
    with pytest.raises(ValueError, match="missing"):
        to_disk_tensors({"model.embed_tokens.weight": torch.zeros(265, 128)}, config)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A few warm-start steps and the checkpoint saved from them (shared by the checks below)."""
    root = tmp_path_factory.mktemp("ws")
    settings = FAST
    base = make_tiny(root / "base", DEFAULT_SPEC)
    result = train_and_evaluate(settings, base, progress=False)
    with atomic_output_dir(root / "out") as tmp:
        save_checkpoint(tmp, result.model, base, DEFAULT_SPEC.shards, result.report)
    return result, root / "out", base


def test_saved_checkpoint_has_deepseek_v3_layout(trained):
    result, out, base = trained
    config = json.loads((out / "config.json").read_text())
    index, tensors = _disk_tensors(out)
    assert config == json.loads((base / "config.json").read_text())
    assert set(tensors) == set(index["weight_map"]) == set(expected_tensors(config))
    assert len(set(index["weight_map"].values())) == DEFAULT_SPEC.shards
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in tensors
    for key, t in tensors.items():
        assert t.dtype == (torch.float32 if key.endswith("e_score_correction_bias") else torch.bfloat16), key
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).exists(), name
    _, before = _disk_tensors(base)
    key = "model.layers.1.mlp.experts.0.gate_proj.weight"
    assert not torch.equal(tensors[key], before[key])  # training changed the experts


def test_report_records_settings_and_metrics(trained):
    result, out, _ = trained
    report = json.loads((out / "warm_start.json").read_text())
    assert report["settings"]["steps"] == 4 and report["settings"]["model"]["hidden_size"] == 128
    assert report["settings"]["task"]["ops"] == ["+"]
    heldout = report["heldout"]
    assert heldout["greedy"]["samples"] == 6 and heldout["sampled"]["samples"] == 12
    assert 0.0 <= heldout["greedy"]["accuracy"] <= 1.0 and heldout["greedy"]["mean_length"] <= 6
    assert len(heldout["greedy_examples"]) == 5
    assert report["final_loss"] > 0


def test_bf16_checkpoint_reloads_with_the_same_logits(trained):
    """quant's frozen loader on the saved checkpoint == the trained model with bf16-rounded weights."""
    result, out, _ = trained
    frozen = load_frozen_model(out, QuantPlan.uniform("bf16"), compute_dtype=torch.float32, progress=False)
    ids = torch.tensor(
        [[0, 3, 63, 80, 73, 92, 229, 25, 19, 26, 39, 4, 41, 86], [0, 3, 25, 19, 26, 17, 18, 19, 20, 21, 22, 23, 24, 4]]
    )
    with torch.no_grad():
        want, got = result.model(input_ids=ids).logits, frozen(input_ids=ids).logits
    assert want.abs().max() > 1.0  # non-trivial logits
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)


def test_warm_start_caches_and_refuses_other_settings(tmp_path, monkeypatch):
    out = warm_start(tmp_path / "base", FAST, progress=False)
    report = json.loads((out / "warm_start.json").read_text())
    assert report["total_seconds"] >= report["train_seconds"]

    def fail(*a, **k):
        raise AssertionError("a cached warm start must not train again")

    monkeypatch.setattr(ws, "train_and_evaluate", fail)
    assert warm_start(tmp_path / "base", FAST, progress=False) == out
    with pytest.raises(
        FileExistsError, match=r"not a warm start with these settings \(stored -> wanted: seed: 0 -> 3; steps: 4 -> 5\)"
    ):
        warm_start(tmp_path / "base", replace(FAST, steps=5, seed=3), progress=False)
    assert json.loads((out / "warm_start.json").read_text()) == report  # untouched
    assert "reasoning" not in report["settings"]["task"]  # a base stored before task.reasoning existed still reads
    written = json.loads((out / "warm_start.json").read_text())  # as the allsync that wrote reasoning: none stored
    written["settings"]["task"]["reasoning"] = "none"
    (out / "warm_start.json").write_text(json.dumps(written))
    assert warm_start(tmp_path / "base", FAST, progress=False) == out
    verbose = replace(FAST, task=replace(FAST.task, reasoning="verbose"))
    with pytest.raises(FileExistsError, match=r"task\.reasoning: None -> 'verbose'"):
        warm_start(tmp_path / "base", verbose, progress=False)


# a warm start as a launched process runs it: the caller's thread count from OMP_NUM_THREADS, the warm start's own
# (settings.train.threads) from argv. A fresh process each, as torchrun and Ray give: in the pytest process an
# in-process vLLM engine of an earlier test has replaced torch.set_num_threads with a no-op.
WARM_START_PROCESS = """
import sys
from dataclasses import replace

import torch
from tests.allsync.test_warm_start import FAST

from allsync.warm_start import warm_start

out, threads = sys.argv[1], int(sys.argv[2])
caller = torch.get_num_threads()
warm_start(out, replace(FAST, train=replace(FAST.train, threads=threads)), progress=False)
assert torch.get_num_threads() == caller, (torch.get_num_threads(), caller)  # the caller's count is back
"""


def _warm_starts_in_processes(runs: dict[str, tuple[int, int]], root: Path) -> dict[str, dict]:
    """{name: (caller's OMP_NUM_THREADS, warm-start threads)} -> {name: the base's tensors}. The processes run side
    by side: each computes with its own fixed thread count, so running together changes their speed, not their bits."""
    procs = {}
    for name, (caller_threads, threads) in runs.items():
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(caller_threads),
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path]),
        }
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", WARM_START_PROCESS, str(root / name), str(threads)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    for name, proc in procs.items():
        _, err = proc.communicate()
        assert proc.returncode == 0, (name, err[-3000:])
    return {name: _disk_tensors(root / name)[1] for name in runs}


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_the_base_does_not_depend_on_the_callers_thread_count(tmp_path):
    """torchrun gives every process OMP_NUM_THREADS=1 and a Ray controller has the machine's cores: the warm
    start computes with its own fixed thread count, so both build the same base. Control: a warm start that
    computes with 1 thread instead of 2 writes other weights (CPU kernels split reductions by thread count)."""
    built = _warm_starts_in_processes({"caller-1": (1, 2), "caller-2": (2, 2), "one-thread": (2, 1)}, tmp_path)
    assert all(torch.equal(built["caller-1"][k], built["caller-2"][k]) for k in built["caller-2"])
    assert not all(torch.equal(built["one-thread"][k], built["caller-2"][k]) for k in built["caller-2"])


def test_a_thread_count_that_cannot_be_set_is_reported(monkeypatch):
    """After vLLM's CPU worker ran in a process, torch.set_num_threads does nothing: the warm start says that it
    computes at another count than its settings name."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # what vLLM's cpu_worker installs
    with pytest.warns(RuntimeWarning, match=f"torch threads stay {torch.get_num_threads()} \\(asked for 7\\)"):
        with ws.torch_threads(7):
            pass


SHIPPED = Path(__file__).parents[2] / "recipes" / "configs"


@pytest.mark.parametrize(
    "config_name",
    ["tiny_cpu.yaml", "tiny_cpu_memory.yaml", "tiny_cpu_memory_single.yaml", "tiny_cpu_agent_calculator.yaml"],
)
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_the_runs_heldout_problems_are_never_warm_start_training_data(config_name, seed):
    """The base a run builds (settings_for_run) is split with the run's task.seed: none of the problems RL holds
    out for that seed is among the warm start's training problems. (Before: the warm start split with seed 0
    whatever task.seed said, and with task.seed 1 195 of the 200 held-out problems were warm-start data.)"""
    import yaml

    from allsync.config import parse_config
    from allsync.warm_start import settings_for_run

    raw = yaml.safe_load((SHIPPED / config_name).read_text())
    config = parse_config({**raw, "task": {**raw.get("task", {}), "seed": seed}})
    settings = settings_for_run(config)
    assert settings.seed == seed
    warm = settings.task.splits(settings.train_size, settings.eval.heldout_size, settings.seed)

    def identity(p):  # a memory-recall problem is its question and the chunks it reads
        return p.prompt, json.dumps(p.metadata, sort_keys=True)

    heldout = {identity(p) for p in config.task.splits()[0].heldout}
    assert len(heldout) == config.task.heldout_size and len(warm.train) == settings.train_size
    assert heldout.isdisjoint(identity(p) for p in warm.train)
    assert heldout == {identity(p) for p in warm.heldout}  # the base was scored on the run's own held-out problems


def test_model_warm_start_steps_sets_the_bases_steps_and_is_refused_without_a_warm_start():
    """model.warm_start_steps goes into the settings the base is built and stored with (a base of 750 steps is not
    one of 300); without model.warm_start it would change nothing, so it is refused by name."""
    from allsync.config import ConfigError, parse_config
    from allsync.warm_start import settings_for_run

    config = parse_config({"model": {"warm_start": True, "warm_start_steps": 300}})
    settings = settings_for_run(config)
    assert settings.steps == 300 and settings.train_size == 300 * 64 and settings.as_json()["steps"] == 300
    assert settings_for_run(parse_config({"model": {"warm_start": True}})).steps == 750
    with pytest.raises(ConfigError, match=r"model\.warm_start_steps = 300 without model\.warm_start"):
        parse_config({"model": {"warm_start_steps": 300}})
    with pytest.raises(ConfigError, match=r"model\.warm_start_steps = 0: must be >= 1"):
        parse_config({"model": {"warm_start": True, "warm_start_steps": 0}})


def test_model_warm_start_shape_sets_the_bases_model_and_is_refused_by_name_when_it_cannot_be_built():
    """model.warm_start_shape (issue 47's two-MoE-layer variant) overrides the default model's shape in the settings
    the base is built and stored with, so a base of one shape is not taken for another; an unknown key, a shape
    TinySpec cannot build and a shape without a warm start are refused by name before any work."""
    from allsync.config import ConfigError, parse_config
    from allsync.warm_start import DEFAULT_SPEC, settings_for_run

    settings = settings_for_run(parse_config({"model": {"warm_start": True, "warm_start_shape": {"layers": 3}}}))
    assert (settings.model.layers, settings.model.dense_layers, settings.model.experts) == (3, 1, DEFAULT_SPEC.experts)
    assert settings.as_json()["model"]["layers"] == 3
    assert settings_for_run(parse_config({"model": {"warm_start": True}})).model == DEFAULT_SPEC
    refused = {
        r"warm_start_shape without model\.warm_start": {"warm_start_shape": {"layers": 3}},
        r"warm_start_shape\.fp8: not a shape key": {"warm_start": True, "warm_start_shape": {"fp8": 1}},
        r"warm_start_shape\.layers = 0: must be >= 1": {"warm_start": True, "warm_start_shape": {"layers": 0}},
        r"warm_start_shape = \{'experts': 5\}: --experts 5 must be divisible": {
            "warm_start": True,
            "warm_start_shape": {"experts": 5},
        },
        r"'model\.warm_start_shape' = .* is not of type": {"warm_start": True, "warm_start_shape": {"layers": "3"}},
    }
    for message, model in refused.items():
        with pytest.raises(ConfigError, match=message):
            parse_config({"model": model})


@pytest.mark.slow  # issue 70: whole runs of many seconds go to the slow lane, which CI runs after the default one
def test_a_short_context_base_reads_long_inputs_in_segments_and_refuses_them_in_one_prompt(tmp_path):
    """model.warm_start_shape.max_position_embeddings (issue 49 item 4, tiny_cpu_memory_long.yaml) gives the base a
    context of 96 positions: config.json and the tokenizer say it, every segmented conversation of six chunks of four
    fits it (the run's own check, the producer's model_len), while the same problems read in one prompt are refused
    by the warm start before it trains, and by the run's check, each naming max_position_embeddings. A base stored
    before the setting existed (no model.max_position_embeddings) still reads as the 4,096-position default."""
    import yaml
    from transformers import AutoTokenizer

    from allsync.config import parse_config
    from allsync.warm_start import settings_for_run
    from benchmarks.multiconv_vs_grpo import single_context_form

    long_config = yaml.safe_load((Path(__file__).parents[2] / "recipes/configs/tiny_cpu_memory_long.yaml").read_text())
    long_config["model"]["base"] = str(tmp_path / "long")
    segmented = parse_config(long_config)
    settings = settings_for_run(segmented)
    assert settings.model.max_position_embeddings == 96
    base = make_tiny(tmp_path / "random", settings.model)
    assert json.loads((base / "config.json").read_text())["max_position_embeddings"] == 96
    tokenizer = AutoTokenizer.from_pretrained(base)
    assert tokenizer.model_max_length == 96
    splits = settings.task.splits(64, 8, 0)
    examples = settings.task.teacher_examples(tokenizer, splits.train, 0)
    ws.check_fits_context(examples, 96)  # every conversation and the answer fit
    assert 80 <= segmented.producer.model_len(segmented, tokenizer, splits.train, 96) <= 96

    single = parse_config(single_context_form(long_config))
    with pytest.raises(
        ValueError,
        match=r"teacher example of 1[45]\d tokens is longer than the model's max_position_"
        r"embeddings \(96, model\.warm_start_shape\.max_position_embeddings\)",
    ):
        warm_start(tmp_path / "single", settings_for_run(single), progress=False)
    assert not (tmp_path / "single").exists() or not any((tmp_path / "single").iterdir())  # nothing half-written
    single_problems = settings_for_run(single).task.splits(64, 8, 0).train
    with pytest.raises(ValueError, match=r"more than the checkpoint's max_position_embeddings \(96\)"):
        single.producer.model_len(single, tokenizer, single_problems, 96)

    stored = WarmStartSettings().as_json()
    assert "max_position_embeddings" not in stored["model"]  # the default is left out, as before it existed
    written = {**stored, "model": {**stored["model"], "max_position_embeddings": 4096}}
    assert ws.without_later_defaults(written) == stored
    assert settings.as_json()["model"]["max_position_embeddings"] == 96
