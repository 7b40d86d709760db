"""NLFT (Natural Language Fine-Tuning, arXiv 2412.20382) against plain SFT on the same 50 examples of the default
task, from the same warm-started base, over the same LoRA-on-MoE stack as RL (issue 27).

    python recipes/nlft.py [--examples 50] [--seeds 0,1,2] [--epochs 8] [--lr 3e-4] [--heldout-samples 4]
                           [--reads-notes] [--base runs/tiny-base] [--out runs/nlft]

Per seed, from the base of recipes/configs/tiny_cpu.yaml (built by its warm start when missing; with --reads-notes
the same warm start with task.reads_notes and twice the steps, at runs/tiny-base-notes: one training prompt in
four carries the standard answer and one in four a judgment of an answer, as below, each followed by the right
answer, so that the base reads them as NLFT's p_std and p_judge assume):
  examples   the first 50 training problems; the base answers each once (at rollout.temperature, the temperature of
             every probability below); a wrong answer gets a
             natural-language judgment naming its wrong digit (`judgment`). Written to OUT/seed-S/examples.jsonl
             ({prompt, answer, response, correct, judgment} a line), which is what training reads: judgments written
             offline by people or another model go in the same field.
  SFT        the likelihood of the standard answers (`Answer: N` + eos) under the plain prompt
  NLFT       the sampled responses scored under the plain prompt (with gradient), under the prompt carrying the
             standard answer, and under the prompt carrying the judgment: allsync.algorithms.nlft's loss
Both: a fresh LoRA (the RL run's rank and targets) trained by the RL learner's update (AdamW with the default run's
betas, gradient clip 1) under the `nlft` policy loss, `--epochs` passes in batches of 10. Reported per method
and seed: held-out accuracy (avg@`--heldout-samples` on the task's held-out problems), training seconds, the
peak bytes the training forwards saved for backward, and the share of trained tokens NLFT found salient (its
unlikelihood terms) over all its batches; per seed, before training, what the judgment does to the digit it names
(`wrong_digit_probe`: the medians of p_judge / p_base and p_std / p_base there, and how often it is salient).
Writes OUT/nlft_vs_sft.json and OUT/nlft_vs_sft.png (each seed's held-out accuracy and training time, both methods).
Last line: `NLFT vs SFT on 50 examples: held-out X% vs Y%`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from allsync.algorithms import nlft_signed_weights
from allsync.algorithms.nlft import salient_tokens
from allsync.config import WARM_START_STEPS, parse_config
from allsync.engines.torch_engine import Sampling
from allsync.update.sequences import build_sequences, response_positions, to_response_layout, to_sequence_layout
from allsync.update.train_batch import TrainBatch
from allsync.tasks import Problem, make_splits
from allsync.tasks.arithmetic import judgment, standard_note, with_note
from allsync.tasks.problems import answer_examples
from allsync.run.worker import RLWorker
from evals.rewards import answer_of, score

ROOT = Path(__file__).resolve().parents[1]
BATCH = 10


def run_config(base: str, reads_notes: bool = False):
    raw = yaml.safe_load((ROOT / "recipes" / "configs" / "tiny_cpu.yaml").read_text())
    raw["model"]["base"] = base
    raw["task"]["reads_notes"] = reads_notes
    if reads_notes:
        # half the warm start's prompts carry a note: twice the config's steps give the plain ones the default's share
        # (at 750 steps the base was right 2.4%)
        raw["model"]["warm_start_steps"] = 2 * raw["model"].get("warm_start_steps", WARM_START_STEPS)
    raw["parallel"] = {"workers_per_node": 1}
    return parse_config(raw)


def write_examples(worker: RLWorker, problems: list[Problem], path: Path, seed: int) -> list[dict]:
    """The base's one sampled answer per problem, scored and judged (module docstring), as JSONL."""
    torch.manual_seed(seed)
    r = worker.config.rollout
    rollout = worker.engine.generate(
        [worker.encode_prompt(p) for p in problems],
        1,
        Sampling(temperature=r.temperature, max_new_tokens=r.max_new_tokens),
    )
    rows = []
    for p, response in zip(problems, rollout.response_ids):
        text = worker.tokenizer.decode(response, skip_special_tokens=True)
        correct = score("arithmetic", text, p.answer) > 0
        note = "" if correct else judgment(answer_of("arithmetic", text), p.answer)
        rows.append(dict(prompt=p.prompt, answer=p.answer, response=response, correct=correct, judgment=note))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return [json.loads(line) for line in path.read_text().splitlines()]


def response_probabilities(learner, prompts, responses) -> torch.Tensor:
    """p of each response token given its prompt, [B, T] (response-aligned), from the learner's own logprob pass:
    the policy's temperature (rollout.temperature), as p_base's."""
    batch = build_sequences(prompts, responses, learner.pad_id)
    index, valid = response_positions(batch.response_mask)
    return to_response_layout(learner.passes.current_logprobs(batch), index, valid).exp()


def note_probabilities(worker: RLWorker, rows: list[dict]):
    """(sequences of the plain prompts and the sampled responses, their logprobs, then p_base, p_std, p_judge [B, T]
    response-aligned): each response's tokens under the plain prompt, the prompt carrying the standard answer and the
    prompt carrying the judgment (a right answer's: judgment(answer, answer)), at the policy's temperature."""
    problems = [Problem(r["prompt"], r["answer"]) for r in rows]
    learner, encode, responses = worker.learner, worker.encode_prompt, [r["response"] for r in rows]
    seqs = build_sequences([encode(p) for p in problems], responses, learner.pad_id)
    index, valid = response_positions(seqs.response_mask)
    logprobs = learner.passes.current_logprobs(seqs)
    std = [encode(with_note(p, standard_note(p.answer))) for p in problems]
    judged = [encode(with_note(p, r["judgment"] or judgment(p.answer, p.answer))) for p, r in zip(problems, rows)]
    p_std = response_probabilities(learner, std, responses)
    p_judge = response_probabilities(learner, judged, responses)
    return seqs, logprobs, to_response_layout(logprobs, index, valid).exp(), p_std, p_judge


def examples_batch(worker: RLWorker, rows: list[dict], method: str) -> TrainBatch:
    """What the learner trains on for a batch of examples, with the `nlft` policy loss (allsync.algorithms.nlft):
    SFT, the standard answers (`Answer: N` + eos) under the plain prompt, every token's weight 1 (its likelihood);
    NLFT, the sampled responses under the plain prompt, weighted by nlft_signed_weights from p_base (the adapter
    now), p_std (the prompt carrying the standard answer) and p_judge (the prompt carrying the judgment), all three
    at the policy's temperature (note_probabilities)."""
    learner = worker.learner
    if method == "sft":
        full = answer_examples(worker.tokenizer, [Problem(r["prompt"], r["answer"]) for r in rows])
        seqs = build_sequences([f[:s] for f, s in full], [f[s:] for f, s in full], learner.pad_id)
        return TrainBatch(seqs, learner.passes.current_logprobs(seqs), seqs.response_mask.clone())
    seqs, old_logprobs, p_base, p_std, p_judge = note_probabilities(worker, rows)
    index, valid = response_positions(seqs.response_mask)
    weights = nlft_signed_weights(p_base, p_std, p_judge, torch.tensor([r["correct"] for r in rows]))
    return TrainBatch(seqs, old_logprobs, to_sequence_layout(weights, index, valid, seqs.response_mask.shape[1]))


def first_wrong_digit(worker: RLWorker, row: dict) -> int | None:
    """The response index of the digit a judgment "wrong at digit i" names (the tokenizer is byte-level: a
    character a token), or None for a row whose judgment names no digit."""
    said = row["judgment"]
    if " is wrong at digit " not in said:
        return None
    digit = int(said.split(" is wrong at digit ")[1].split(":")[0]) - 1
    text = worker.tokenizer.decode(row["response"], skip_special_tokens=True)
    answer = answer_of("arithmetic", text)
    return text.rindex(answer) + digit if answer else None


def wrong_digit_probe(worker: RLWorker, rows: list[dict]) -> dict:
    """What the judgment does to the token it names, before training: at the first wrong digit of each wrong answer
    of the right length, the medians of p_judge / p_base and p_std / p_base, and the share of those tokens NLFT calls
    salient (both ratios above 1.5: allsync.algorithms.nlft.salient_tokens)."""
    named = [(r, i) for r in rows if (i := first_wrong_digit(worker, r)) is not None]
    if not named:
        return {"tokens": 0}
    _, _, p_base, p_std, p_judge = note_probabilities(worker, [r for r, _ in named])
    at = torch.arange(len(named)), torch.tensor([i for _, i in named])
    base, std, judge = p_base[at], p_std[at], p_judge[at]
    return {
        "tokens": len(named),
        "judge_over_base": float((judge / base).median()),
        "std_over_base": float((std / base).median()),
        "salient": float(salient_tokens(base, std, judge).float().mean()),
    }


def train(worker: RLWorker, rows: list[dict], method: str, epochs: int, seed: int) -> tuple[float, int, float]:
    """`epochs` passes over the examples in batches of BATCH through the RL learner's update (its AdamW, gradient
    clip and buffers) with the `nlft` policy loss. Returns (seconds, peak bytes saved for backward by one update,
    the share of trained tokens with a negative weight: NLFT's salient, unlikelihood tokens)."""
    learner = worker.learner
    learner.loss_settings = replace(learner.loss_settings, policy_loss="nlft")  # this recipe's loss, not a config key
    order = torch.Generator().manual_seed(seed)
    peak, salient, trained = 0, 0, 0
    start = time.perf_counter()
    for _ in range(epochs):
        perm = torch.randperm(len(rows), generator=order).tolist()
        for i in range(0, len(rows), BATCH):
            tb = examples_batch(worker, [rows[j] for j in perm[i : i + BATCH]], method)
            mask = tb.sequences.response_mask > 0
            salient, trained = salient + int((tb.advantages[mask] < 0).sum()), trained + int(mask.sum())
            saved: dict[int, int] = {}

            def pack(t):
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                learner.update(worker.policy, tb)
            peak = max(peak, sum(saved.values()))
            worker.policy.version += 1
    return time.perf_counter() - start, peak, salient / max(trained, 1)


def heldout_accuracy(worker: RLWorker, problems: list[Problem], samples: int) -> float:
    records = worker.evaluate(problems, samples)
    return sum(bool(r["correct"]) for r in records) / len(records)


def plot(results: dict, path: Path) -> None:
    """Held-out accuracy after training, SFT beside NLFT for each seed, the base's across; and each method's training
    seconds per seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = [r["seed"] for r in results["sft"]]
    fig, (accuracy, seconds) = plt.subplots(1, 2, figsize=(9, 3.8))
    for offset, method in ((-0.2, "sft"), (0.2, "nlft")):
        xs = [i + offset for i in range(len(seeds))]
        accuracy.bar(xs, [100 * r["heldout"] for r in results[method]], width=0.4, label=method.upper())
        seconds.bar(xs, [r["seconds"] for r in results[method]], width=0.4, label=method.upper())
    accuracy.axhline(100 * results["base"], color="black", linestyle="--", linewidth=1, label="base")
    accuracy.set(xlabel="seed", ylabel="held-out accuracy (avg@4, %)", title="after training on the same examples")
    seconds.set(xlabel="seed", ylabel="seconds", title="training time")
    for ax in (accuracy, seconds):
        ax.set_xticks(range(len(seeds)), [str(s) for s in seeds])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=50)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--heldout-samples", type=int, default=4)
    parser.add_argument(
        "--base",
        default=None,
        help="the warm-started base (default runs/tiny-base, or with --reads-notes runs/tiny-base-notes)",
    )
    parser.add_argument(
        "--reads-notes",
        action="store_true",
        help="a base warm-started with task.reads_notes: it has read prompts carrying the standard answer or a "
        "judgment, each followed by the right answer",
    )
    parser.add_argument("--out", default="runs/nlft")
    args = parser.parse_args(argv)
    args.base = args.base or ("runs/tiny-base-notes" if args.reads_notes else "runs/tiny-base")
    config = run_config(args.base, args.reads_notes)
    config.optim.lr = args.lr
    if not (Path(args.base) / "config.json").exists():
        from allsync.warm_start import settings_for_run, warm_start

        config.model.warm_start = True
        warm_start(args.base, settings_for_run(config))
    splits = make_splits(config.task.generator(), config.task.train_size, config.task.heldout_size, config.task.seed)
    problems = splits.train[: args.examples]
    seeds = [int(s) for s in args.seeds.split(",")]
    results: dict = {"base": None, "sft": [], "nlft": []}
    for seed in tqdm(seeds, desc="seeds", unit="seed"):
        rows = None
        for method in ("sft", "nlft"):
            torch.manual_seed(seed)
            worker = RLWorker(config, splits.train)
            try:
                if results["base"] is None:
                    results["base"] = heldout_accuracy(worker, splits.heldout, args.heldout_samples)
                if rows is None:
                    rows = write_examples(worker, problems, Path(args.out) / f"seed-{seed}" / "examples.jsonl", seed)
                    probe = results.setdefault("wrong_digit_probe", {})[seed] = wrong_digit_probe(worker, rows)
                    print(f"seed {seed} the judged digit before training: {probe}", flush=True)
                seconds, peak, salient = train(worker, rows, method, args.epochs, seed)
                accuracy = heldout_accuracy(worker, splits.heldout, args.heldout_samples)
            finally:  # each method's worker (its reward processes) ends before the next starts
                worker.shutdown()
            results[method].append(
                dict(seed=seed, heldout=accuracy, seconds=seconds, peak_saved_bytes=peak, salient_share=salient)
            )
            print(
                f"seed {seed} {method:<4} held-out {accuracy:.1%}  training {seconds:.1f} s  "
                f"peak saved for backward {peak / 1e6:.2f} MB  salient tokens {salient:.1%}  "
                f"(examples: {sum(r['correct'] for r in rows)} of "
                f"{len(rows)} answered right by the base)",
                flush=True,
            )
    mean = {m: statistics.mean(r["heldout"] for r in results[m]) for m in ("sft", "nlft")}
    out = Path(args.out) / "nlft_vs_sft.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, out.with_suffix(".png"))
    print(f"base held-out {results['base']:.1%}; wrote {out} and {out.with_suffix('.png')}")
    print(f"NLFT vs SFT on {args.examples} examples: held-out {mean['nlft']:.1%} vs {mean['sft']:.1%}")
    return results


if __name__ == "__main__":
    main()
