"""Answer extraction, verification (math_verify), rewards and metrics.

Dependency rule: evals imports neither allsync, quant nor moe_lora (allsync uses evals).
"""

from evals.extract import extract_answer
from evals.metrics import EvalSummary, avg_at_k, correct_per_1k_tokens, mean_pass_at_k, pass_at_k, summarize
from evals.verify import answer_reward, is_correct, is_equivalent

__all__ = [
    "EvalSummary",
    "answer_reward",
    "avg_at_k",
    "correct_per_1k_tokens",
    "extract_answer",
    "is_correct",
    "is_equivalent",
    "mean_pass_at_k",
    "pass_at_k",
    "summarize",
]
