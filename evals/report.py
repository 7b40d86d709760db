"""An evaluation's samples, its summary and its plot, as `allsync eval` and the recipe's held-out
evaluations write them.

    records = [SampleRecord(problem_id=0, prompt=..., response=..., answer="42", score=1.0, correct=True, tokens=12), ...]
    summary = summarize_samples(records, n=32)
    summary["avg@32"], summary["pass@k"]["8"], summary["maj@32"]
    write_evaluation(out_dir, records, summary)   # samples.jsonl, summary.json, eval.png

Every problem has n samples. With c_p of problem p's n samples correct:
    avg@n   = (1/P) sum_p c_p / n                                  (AIME-style mean accuracy)
    pass@k  = (1/P) sum_p [1 - C(n - c_p, k) / C(n, k)]            for k = 1, 2, 4, ... and n (unbiased)
    maj@n   = (1/P) sum_p correct(most frequent extracted answer of p)   (majority vote; samples without an
              answer do not vote, a problem with no answer at all counts as wrong, ties go to the answer seen first)
    format_rate = share of samples with an extracted answer, mean_tokens = mean response tokens,
    correct_per_1k_tokens = 1000 * correct samples / response tokens.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from evals.metrics import avg_at_k, correct_per_1k_tokens, mean_pass_at_k


@dataclass(frozen=True)
class SampleRecord:
    problem_id: int
    prompt: str | list
    response: str
    answer: str | None  # what the reward read from the response (None: no answer found)
    score: float
    correct: bool
    tokens: int  # response tokens, eos included when produced
    finish_reason: str = "stop"  # "stop" or "length"
    tool_calls: int | None = None  # tool agents: the episode's tool calls


def pass_ks(n: int) -> list[int]:
    """k = 1, 2, 4, ... below n, then n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def by_problem(records: Sequence[SampleRecord], n: int) -> list[list[SampleRecord]]:
    """Records grouped per problem (in problem-id order); every problem must have exactly n."""
    groups: dict[int, list[SampleRecord]] = {}
    for r in records:
        groups.setdefault(r.problem_id, []).append(r)
    wrong = {p: len(g) for p, g in groups.items() if len(g) != n}
    if not groups or wrong:
        raise ValueError(
            f"every problem needs {n} samples; got {len(groups)} problems, sample counts {wrong or 'none'}"
        )
    return [groups[p] for p in sorted(groups)]


def majority_correct(group: Sequence[SampleRecord]) -> bool:
    """Whether the most frequent extracted answer of a problem's samples is correct (module docstring)."""
    votes = Counter(r.answer for r in group if r.answer is not None)
    if not votes:
        return False
    winner = votes.most_common(1)[0][0]
    return next(r.correct for r in group if r.answer == winner)


def summarize_samples(records: Sequence[SampleRecord], n: int) -> dict:
    """avg@n, pass@k, maj@n, format_rate, mean_tokens, correct_per_1k_tokens over problems with n samples each
    (and tool_call_rate, the fraction of samples with a tool call, for tool agents)."""
    groups = by_problem(records, n)
    correct = [[r.correct for r in g] for g in groups]
    flat = [r for g in groups for r in g]
    return {
        "n": n,
        "problems": len(groups),
        "samples": len(flat),
        f"avg@{n}": avg_at_k(correct),
        "pass@k": {str(k): mean_pass_at_k(correct, k) for k in pass_ks(n)},
        f"maj@{n}": sum(map(majority_correct, groups)) / len(groups),
        "format_rate": sum(r.answer is not None for r in flat) / len(flat),
        "mean_tokens": sum(r.tokens for r in flat) / len(flat),
        "correct_per_1k_tokens": correct_per_1k_tokens([r.correct for r in flat], [r.tokens for r in flat]),
        "truncated_rate": sum(r.finish_reason == "length" for r in flat) / len(flat),
        **(
            {"tool_call_rate": sum(bool(r.tool_calls) for r in flat) / len(flat)}
            if flat[0].tool_calls is not None
            else {}
        ),
    }


def summary_line(summary: dict) -> str:
    """`avg@n: X% pass@n: Y%`, the last line `allsync eval` prints."""
    n = summary["n"]
    return f"avg@{n}: {100 * summary[f'avg@{n}']:.1f}% pass@{n}: {100 * summary['pass@k'][str(n)]:.1f}%"


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_evaluation(
    out_dir: str | os.PathLike, records: Sequence[SampleRecord], summary: dict, plot: bool = True
) -> Path:
    """DIR/samples.jsonl (one record per line), DIR/summary.json and DIR/eval.png, each written whole."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / "samples.jsonl", "".join(json.dumps(asdict(r)) + "\n" for r in records))
    _atomic_write(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    if plot:
        plot_evaluation(records, summary, out / "eval.png")
    return out


def length_bins(records: Sequence[SampleRecord], bins: int = 8) -> list[tuple[float, float, int]]:
    """(mean length, accuracy, samples) per bin. With at most `bins` distinct lengths, one bin per length;
    else samples sorted by length go to bin floor(i * bins / N), i the sorted position of the first sample of
    their length, so that equal lengths share a bin."""
    ordered = sorted(records, key=lambda r: r.tokens)
    first: dict[int, int] = {}
    for i, r in enumerate(ordered):
        first.setdefault(r.tokens, i)
    few = len(first) <= bins
    chunks: dict[int, list[SampleRecord]] = {}
    for r in ordered:
        chunks.setdefault(r.tokens if few else first[r.tokens] * bins // len(ordered), []).append(r)
    return [(sum(r.tokens for r in c) / len(c), sum(r.correct for r in c) / len(c), len(c)) for c in chunks.values()]


def plot_evaluation(records: Sequence[SampleRecord], summary: dict, path: str | os.PathLike) -> Path:
    """Two panels: pass@k against k (log2 axis), and accuracy against response length (equal-count bins)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    ks = [int(k) for k in summary["pass@k"]]
    left.plot(ks, [100 * summary["pass@k"][str(k)] for k in ks], marker="o")
    left.set_xscale("log", base=2)
    left.set(
        xlabel="k (samples)", ylabel="pass@k (%)", title=f"pass@k over {summary['problems']} problems", ylim=(0, 100)
    )
    points = length_bins(records)
    right.plot([p[0] for p in points], [100 * p[1] for p in points], marker="o")
    for length, accuracy, count in points:
        right.annotate(
            str(count), (length, 100 * accuracy), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8
        )
    right.set(
        xlabel="response tokens (bin mean; labels: samples)",
        ylabel="accuracy (%)",
        ylim=(0, 100),
        title=f"accuracy by length ({summary['samples']} samples)",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
