"""Evaluation metrics over sampled responses.

pass@k (Chen et al. 2021, unbiased): with n samples of which c are correct,
    pass@k = 1 - C(n-c, k) / C(n, k)  = 1 - prod_{i=n-c+1}^{n} (1 - k/i)     (1.0 when n - c < k)
    e.g. n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7.
avg@k (AIME-style): k samples per problem, mean accuracy over problems and samples,
    avg@k = (1/P) sum_p (1/k) sum_j correct_pj.
Balanced reasoning (accuracy per token): correct answers per 1000 generated tokens,
    correct_per_1k_tokens = 1000 * sum(correct) / sum(lengths) = 1000 * accuracy / mean_length,
    so a model that is as accurate with half the tokens scores twice as high.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimate from n samples with c correct (product form, no big binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_pass_at_k(correct_per_problem: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over problems, each with its own list of per-sample correctness."""
    if not correct_per_problem:
        raise ValueError("mean_pass_at_k of no problems")
    return sum(pass_at_k(len(s), sum(map(bool, s)), k) for s in correct_per_problem) / len(correct_per_problem)


def avg_at_k(correct_per_problem: Sequence[Sequence[bool]]) -> float:
    """Mean accuracy over problems and their k samples; every problem must have the same k >= 1."""
    ks = {len(s) for s in correct_per_problem}
    if not correct_per_problem or len(ks) != 1 or 0 in ks:
        raise ValueError(f"avg_at_k needs the same k >= 1 samples per problem, got sample counts {sorted(ks)}")
    (k,) = ks
    return sum(sum(map(bool, s)) for s in correct_per_problem) / (k * len(correct_per_problem))


def correct_per_1k_tokens(correct: Sequence[bool], lengths: Sequence[int]) -> float:
    """1000 * (#correct) / (#generated tokens), the same as 1000 * accuracy / mean length."""
    if len(correct) != len(lengths):
        raise ValueError(f"{len(correct)} correctness flags but {len(lengths)} lengths")
    tokens = sum(lengths)
    return 1000.0 * sum(map(bool, correct)) / tokens if tokens else 0.0


@dataclass(frozen=True)
class EvalSummary:
    """One evaluation: accuracy, how often an answer could be extracted, length, accuracy per token."""

    samples: int
    accuracy: float
    format_rate: float
    mean_length: float
    correct_per_1k_tokens: float


def summarize(correct: Sequence[bool], formatted: Sequence[bool], lengths: Sequence[int]) -> EvalSummary:
    if not correct or not len(correct) == len(formatted) == len(lengths):
        raise ValueError(
            f"summarize needs equal, non-empty lists (got {len(correct)}, {len(formatted)}, {len(lengths)})"
        )
    n = len(correct)
    return EvalSummary(
        samples=n,
        accuracy=sum(map(bool, correct)) / n,
        format_rate=sum(map(bool, formatted)) / n,
        mean_length=sum(lengths) / n,
        correct_per_1k_tokens=correct_per_1k_tokens(correct, lengths),
    )
