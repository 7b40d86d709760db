"""Held-out evaluation of a transformers causal LM: greedy and temperature-T samples, verified answers.

    report = evaluate_model(model, tokenizer, prompt_ids, answers, EvalSettings(samples_per_problem=4))
    report["greedy"]["accuracy"], report["avg@4"], report["pass@4"], report["mixed_group_rate"]

mixed_group_rate: share of problems whose k samples are neither all right nor all wrong, i.e. the
groups that carry a GRPO/DAPO learning signal (advantages are 0 in a group with equal rewards).
Works with any model that has transformers' `generate` (a plain or a quant-loaded frozen model).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from evals.extract import extract_answer
from evals.metrics import avg_at_k, mean_pass_at_k, summarize
from evals.verify import is_correct


@dataclass(frozen=True)
class EvalSettings:
    heldout_size: int = 200
    samples_per_problem: int = 4  # temperature-T samples per problem (avg@k, pass@k, mixed groups)
    temperature: float = 1.0
    max_new_tokens: int = 12
    batch_size: int = 100


@dataclass(frozen=True)
class Generated:
    text: str
    tokens: int  # generated tokens, eos included when it was produced


def left_pad(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask (generation appends on the right)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, width - len(s) :], mask[i, width - len(s) :] = torch.tensor(s, dtype=torch.long), 1
    return ids, mask


def cut_at_eos(tokens: list[int], eos_id: int) -> tuple[list[int], str]:
    """Response tokens up to and including the first eos ("stop"), else all of them ("length"). Generation pads
    only after an eos, so a row without eos has no padding."""
    if eos_id in tokens:
        return tokens[: tokens.index(eos_id) + 1], "stop"
    return tokens, "length"


@torch.no_grad()
def generate(
    model,
    tokenizer,
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    temperature: float | None = None,
    batch_size: int = 100,
) -> list[Generated]:
    """transformers generate in left-padded batches; greedy when temperature is None, else full-vocab sampling."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if temperature is None:
        sampling = {"do_sample": False}
    else:
        sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    results = []
    for i in range(0, len(prompt_ids), batch_size):
        ids, mask = left_pad(prompt_ids[i : i + batch_size], pad)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos,
            pad_token_id=pad,
            **sampling,
        )
        for row in out[:, ids.shape[1] :].tolist():
            kept, _ = cut_at_eos(row, eos)
            results.append(Generated(tokenizer.decode(kept, skip_special_tokens=True), len(kept)))
    return results


def _summary(generated: list[Generated], answers: list[str]) -> tuple[list[bool], dict]:
    correct = [is_correct(g.text, a) for g, a in zip(generated, answers)]
    formatted = [extract_answer(g.text) is not None for g in generated]
    return correct, asdict(summarize(correct, formatted, [g.tokens for g in generated]))


def evaluate_model(
    model, tokenizer, prompt_ids: list[list[int]], answers: list[str], settings: EvalSettings, seed: int = 0
) -> dict:
    """Greedy summary, temperature-T summary over k samples per prompt, avg@k, pass@k, mixed_group_rate."""
    k = settings.samples_per_problem
    greedy = generate(model, tokenizer, prompt_ids, settings.max_new_tokens, None, settings.batch_size)
    torch.manual_seed(seed)
    repeated = [p for p in prompt_ids for _ in range(k)]
    sampled = generate(model, tokenizer, repeated, settings.max_new_tokens, settings.temperature, settings.batch_size)
    _, greedy_summary = _summary(greedy, answers)
    s_correct, sampled_summary = _summary(sampled, [a for a in answers for _ in range(k)])
    per_problem = [s_correct[j * k : (j + 1) * k] for j in range(len(answers))]
    return {
        "greedy": greedy_summary,
        "sampled": sampled_summary,
        f"avg@{k}": avg_at_k(per_problem),
        f"pass@{k}": mean_pass_at_k(per_problem, k),
        "mixed_group_rate": sum(0 < sum(s) < k for s in per_problem) / len(per_problem),
        "greedy_examples": [{"response": g.text, "answer": a} for g, a in zip(greedy[:5], answers[:5])],
    }
