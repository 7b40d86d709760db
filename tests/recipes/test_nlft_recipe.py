"""recipes/nlft.py: the judgments it writes for the tiny task, and a short run of both methods end to end."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
from nlft import main  # noqa: E402

from allsync.tasks.arithmetic import judgment


@pytest.mark.parametrize(
    "answer, truth, said",
    [
        ("457", "467", "the answer 457 is wrong at digit 2: 5 should be 6"),
        ("45", "467", "the answer 45 has 2 digits, the right one has 3"),
        (None, "467", "the reply gives no answer; the answer is 467"),
        ("467", "467", "the answer 467 is right"),
    ],
)
def test_the_judgment_names_the_wrong_digit(answer, truth, said):
    assert judgment(answer, truth) == said


def test_both_methods_train_from_the_same_examples_and_are_evaluated(warm_tiny, tmp_path, capsys):
    results = main(
        ["--seeds", "0", "--epochs", "1", "--examples", "10", "--base", str(warm_tiny), "--out", str(tmp_path)]
    )
    rows = [json.loads(line) for line in (tmp_path / "seed-0" / "examples.jsonl").read_text().splitlines()]
    assert len(rows) == 10 and all(set(r) == {"prompt", "answer", "response", "correct", "judgment"} for r in rows)
    assert all(bool(r["judgment"]) != r["correct"] for r in rows)  # a judgment for each wrong answer, none else
    for method in ("sft", "nlft"):
        assert len(results[method]) == 1 and 0 <= results[method][0]["heldout"] <= 1
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("NLFT vs SFT on 10 examples: held-out ")
    assert (tmp_path / "nlft_vs_sft.png").stat().st_size > 10_000  # the plot beside the JSON


def test_every_probability_is_at_the_policys_temperature_and_each_worker_is_shut_down(warm_tiny, tmp_path, monkeypatch):
    """p_base, p_std and p_judge at rollout.temperature (0.5 here): the batch's weights are nlft_signed_weights of
    the three computed by hand at that temperature (p_std and p_judge were at 1 before). main() shuts down the
    worker of each method (the SFT one was left running before)."""
    import nlft
    import torch

    from allsync.algorithms import nlft_signed_weights
    from allsync.update.forward import forward_logprobs
    from allsync.update.sequences import build_sequences, response_positions, to_response_layout
    from allsync.tasks import Problem
    from allsync.run.worker import RLWorker

    config = nlft.run_config(str(warm_tiny))
    config.rollout.temperature = 0.5
    problems = [Problem(f"what is {a}+{a}?", str(2 * a)) for a in range(1, 5)]
    worker = RLWorker(config, problems)
    try:
        rows = nlft.write_examples(worker, problems, tmp_path / "examples.jsonl", seed=0)
        tb = nlft.examples_batch(worker, rows, "nlft")

        def probabilities(notes: list[str]) -> torch.Tensor:
            prompts = [worker.encode_prompt(nlft.with_note(p, n) if n else p) for p, n in zip(problems, notes)]
            batch = build_sequences(prompts, [r["response"] for r in rows], worker.learner.pad_id)
            index, valid = response_positions(batch.response_mask)
            with torch.no_grad():
                return to_response_layout(forward_logprobs(worker.model, batch, 0.5), index, valid).exp(), valid

        p_base, valid = probabilities([""] * len(rows))
        p_std, _ = probabilities([f"the correct answer is {p.answer}" for p in problems])
        p_judge, _ = probabilities([r["judgment"] or f"the answer {r['answer']} is right" for r in rows])
        want = nlft_signed_weights(p_base, p_std, p_judge, torch.tensor([r["correct"] for r in rows])) * valid
        index, ok = response_positions(tb.sequences.response_mask)
        assert torch.allclose(to_response_layout(tb.advantages, index, ok), want, atol=1e-5)
    finally:
        worker.shutdown()
    shut = []
    original = RLWorker.shutdown
    monkeypatch.setattr(RLWorker, "shutdown", lambda self: (shut.append(self), original(self)))
    main(["--seeds", "0", "--epochs", "1", "--examples", "2", "--base", str(warm_tiny), "--out", str(tmp_path)])
    assert len(shut) == 2 and shut[0] is not shut[1]
