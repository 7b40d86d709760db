"""Scoring and evaluation shared by the training loop and `allsync eval`.

    scores, correct, errors = score_texts(pool, reward, problems, texts)
    records = sample_records(engine, tokenizer, problems, problem_ids, n, sampling, pool, reward)
    summary = evals.report.summarize_samples(records, n)        # avg@n, pass@k, maj@n, ...

The worker scores training samples with `score_texts` and evaluates held-out problems with
`sample_records`; `allsync eval` (`evaluate_cli`) runs the same two functions on a base, an adapter and a
data file, with the torch engine (our frozen model with the adapter attached) or vLLM (the adapter hot-loaded
as users serve it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from allsync.config import RewardSection, RunConfig
from allsync.distributed.devices import worker_device
from allsync.engines.torch_engine import Sampling
from allsync.producers.single_turn import engine_answers
from allsync.tasks import Problem, encode_prompt, reward_row
from evals.report import SampleRecord
from evals.reward_pool import RewardPool
from evals.rewards import answer_of, is_correct_score, wrong_score


class RewardError(RuntimeError):
    """A reward raised or timed out and reward.on_error is fail."""


def reward_name(reward: RewardSection) -> str:
    """The registry name the reward scores with ("" for a user function)."""
    return reward.name if reward.function is None else ""


def score_texts(
    pool: RewardPool, reward: RewardSection, problems: list[Problem], texts: list[str], where: str = ""
) -> tuple[list[float], list[bool], int]:
    """(scores, correct, errors) of responses `texts` to `problems` in the reward processes. A sample whose
    reward raised or timed out stops the run naming it (reward.on_error fail) or scores as wrong (wrong)."""
    if not texts:  # a rank with nothing of its own (expert parallelism) still runs the engine's rounds
        return [], [], 0
    results = pool.score([(t, reward_row(p)) for t, p in zip(texts, problems)])
    name = reward_name(reward)
    scores, errors = [], 0
    for i, r in enumerate(results):
        if r.error is not None:
            errors += 1
            if reward.on_error == "fail":
                raise RewardError(
                    f"reward {reward.function or reward.name} failed on sample {i}{where} (prompt "
                    f"{problems[i].prompt!r}, response {texts[i]!r}): {r.error} (reward.on_error: fail)"
                )
        scores.append(wrong_score(name) if r.error is not None else r.score)
    return scores, [is_correct_score(name, s) for s in scores], errors


def sample_records(
    engine,
    tokenizer,
    problems: list[Problem],
    problem_ids: list[int],
    n: int,
    sampling: Sampling,
    pool: RewardPool,
    reward: RewardSection,
    where: str = "",
) -> list[SampleRecord]:
    """n responses per problem from `engine`, scored: one SampleRecord per response."""
    answers = engine_answers(engine, lambda p: encode_prompt(tokenizer, p), problems, n, sampling)
    return answer_records(tokenizer, pool, reward, problems, problem_ids, n, answers, where)


def answer_records(
    tokenizer,
    pool: RewardPool,
    reward: RewardSection,
    problems: list[Problem],
    problem_ids: list[int],
    n: int,
    answers: list[tuple[list[int], str]],
    where: str = "",
) -> list[SampleRecord]:
    """n answers per problem, each (response ids, finish reason), scored: one SampleRecord per answer."""
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids, _ in answers]
    owners = [problems[i // n] for i in range(len(answers))]
    scores, correct, _ = score_texts(pool, reward, owners, texts, where)
    name = reward_name(reward)
    return [
        SampleRecord(
            problem_ids[i // n],
            reward_row(owners[i])["prompt"],
            text,
            answer_of(name, text),
            score,
            ok,
            len(ids),
            reason,
        )
        for i, (text, score, ok, (ids, reason)) in enumerate(zip(texts, scores, correct, answers))
    ]


def heldout_records(
    producer,
    tokenizer,
    pool: RewardPool,
    config: RunConfig,
    problems: list[Problem],
    problem_ids: list[int],
    samples: int,
    memory: str = "own",
    where: str = "",
) -> list[SampleRecord]:
    """Held-out evaluation of `problems[i] for i in problem_ids` as the run's producer answers them (its `evaluate`,
    allsync.producers.registry.Producer): greedy (samples=1) or `samples` responses at the rollout temperature with
    run.eval_top_p, scored. Agents run their turns, multi-conversation episodes run whole and their last answer is
    scored (`memory` blank / gold: from an empty or the task's gold memory instead of the episode's own, the memory
    ablation)."""
    greedy = samples == 1
    sampling = Sampling(
        temperature=1.0 if greedy else config.rollout.temperature,
        top_p=config.run.eval_top_p,
        max_new_tokens=config.rollout.max_new_tokens,
        greedy=greedy,
    )
    mine = [problems[i] for i in problem_ids]

    def score_answers(problems: list[Problem], ids: list[int], n: int, answers: list[tuple[list[int], str]]):
        return answer_records(tokenizer, pool, config.reward, problems, ids, n, answers, where)

    return producer.evaluate(mine, problem_ids, samples, sampling, memory, score_answers)


# ------------------------------------------------------------------------------------------ allsync eval
@dataclass(frozen=True)
class EvalArgs:
    src: str  # a training checkpoint, a PEFT adapter directory, or "none" (the base alone)
    base: str
    data: str
    out: str
    engine: str = "torch"  # torch | vllm
    n: int = 32
    temperature: float = 1.0  # 0: greedy
    top_p: float = 0.7
    max_new_tokens: int = 1024
    reward: str = "math_dapo"
    reward_timeout_s: float = 10.0
    on_error: str = "fail"
    template: str | None = None
    batch_problems: int = 8  # problems per generate call (x n sequences)
    seed: int = 0
    compute_dtype: str = "float32"
    device: str = "auto"
    overwrite: bool = False
    plan: object = (
        None  # torch engine: the frozen formats (quant.loader.QuantPlan; None: its defaults, NF4 routed experts)
    )


def resolved_device(device: str) -> str:
    """auto: cuda when a GPU is visible, else cpu."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


def check_eval_args(args: EvalArgs) -> None:
    """Every setting is usable, before any model is loaded: ValueError naming the option."""
    from evals.rewards import REWARDS

    if args.engine not in ("torch", "vllm"):
        raise ValueError(f"--engine {args.engine!r}: use torch or vllm")
    if args.n < 1 or args.batch_problems < 1 or args.max_new_tokens < 1:
        raise ValueError("--n, --batch-problems and --max-new-tokens must be >= 1")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise ValueError(
            f"--temperature {args.temperature} must be >= 0 (0: greedy) and --top-p {args.top_p} in (0, 1]"
        )
    if args.temperature == 0 and args.n > 1:
        raise ValueError(f"--temperature 0 is greedy: every one of --n {args.n} samples would be the same; use --n 1")
    if args.reward not in REWARDS or REWARDS[args.reward].needs_metadata:
        usable = [name for name, reward in REWARDS.items() if not reward.needs_metadata]
        raise ValueError(
            f"--reward {args.reward!r}: use one of {', '.join(usable)} (data files carry no reasoning-gym metadata)"
        )
    if args.device not in ("auto", "cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        raise ValueError(f"--device {args.device!r}: use auto, cpu or cuda (cuda needs a visible GPU)")
    if args.on_error not in ("fail", "wrong"):
        raise ValueError(f"--on-error {args.on_error!r}: use fail or wrong")
    if args.compute_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--compute-dtype {args.compute_dtype!r}: use float32 or bfloat16")
    if not (Path(args.base) / "config.json").exists():
        raise ValueError(f"--base {args.base}: no checkpoint there (config.json missing)")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        raise FileExistsError(f"--out {out} exists and is not empty (use --overwrite)")


def load_eval_problems(path: str, template: str | None) -> tuple[list[Problem], str]:
    """The data file's unique rows as Problems, and its report line (rows read, unique prompts)."""
    from evals.datasets import DAPO_MATH_TEMPLATE, load_rows

    rows, report = load_rows(path, DAPO_MATH_TEMPLATE if template == "dapo_math" else template)
    return [Problem(r.prompt, r.answer) for r in rows], report


def make_eval_engine(args: EvalArgs, adapter, tokenizer, problems: list[Problem]):
    """The torch engine (our frozen base with the adapter attached) or vLLM serving the adapter."""
    from allsync.engines.torch_engine import TorchEngine
    from allsync.tasks import longest_prompt_tokens, model_len_needed
    from quant.checkpoint_io import read_config

    if args.engine == "vllm":
        from allsync.engines.vllm_engine import VLLMEngine  # refuses what this machine's vLLM cannot run

        model_len = model_len_needed(
            longest_prompt_tokens(tokenizer, problems),
            args.max_new_tokens,
            read_config(args.base)["max_position_embeddings"],
        )
        r, alpha, rslora = (
            (adapter.r, adapter.lora_alpha, adapter.use_rslora) if adapter is not None else (8, 8.0, False)
        )
        engine = VLLMEngine(args.base, r, alpha, rslora, dtype=args.compute_dtype, max_model_len=model_len)
        engine.load_adapter(adapter.tensors if adapter is not None else None, 1)
        from allsync.engines.sync_check import check_checksums

        check_checksums(1, engine.sent_checksum, engine.received_checksums)  # the bytes vLLM received
        return engine
    from moe_lora.adapter_io import attach_adapter
    from quant.loader import QuantPlan, load_frozen_model

    device = worker_device(resolved_device(args.device), launcher=False)
    model = load_frozen_model(
        args.base, args.plan or QuantPlan(), compute_dtype=getattr(torch, args.compute_dtype), device=device
    )
    if adapter is not None:
        attach_adapter(model, adapter)
    model.eval()
    return TorchEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)


def evaluate_cli(args: EvalArgs) -> dict:
    """`allsync eval`: n samples per unique problem of the data file, scored; writes samples.jsonl,
    summary.json and eval.png to args.out and returns the summary."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from evals.report import summarize_samples, summary_line, write_evaluation
    from evals.reward_pool import RewardSpec
    from moe_lora.adapter_io import read_adapter
    from quant.checkpoint_io import read_config

    check_eval_args(args)
    problems, report = load_eval_problems(args.data, args.template)
    print(report)
    adapter = None if args.src == "none" else read_adapter(args.src, read_config(args.base))
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    engine = make_eval_engine(args, adapter, tokenizer, problems)
    greedy = args.temperature == 0
    sampling = Sampling(
        temperature=1.0 if greedy else args.temperature,
        top_p=1.0 if greedy else args.top_p,
        max_new_tokens=args.max_new_tokens,
        greedy=greedy,
    )
    reward = RewardSection(name=args.reward, timeout_s=args.reward_timeout_s, on_error=args.on_error)
    torch.manual_seed(args.seed)
    records: list[SampleRecord] = []
    with (
        RewardPool(RewardSpec(args.reward, None, args.reward_timeout_s)) as pool,
        tqdm(total=len(problems), unit="problem", desc=f"eval n={args.n}") as bar,
    ):
        for start in range(0, len(problems), args.batch_problems):
            chunk = problems[start : start + args.batch_problems]
            ids = list(range(start, start + len(chunk)))
            records += sample_records(engine, tokenizer, chunk, ids, args.n, sampling, pool, reward)
            bar.update(len(chunk))
    summary = summarize_samples(records, args.n)
    summary.update(
        src=args.src,
        base=os.path.abspath(args.base),
        data=os.path.abspath(args.data),
        engine=args.engine,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        reward=args.reward,
    )
    write_evaluation(args.out, records, summary)
    if hasattr(engine, "close"):
        engine.close()
    print(f"wrote {args.out}/samples.jsonl ({len(records)} samples), summary.json, eval.png")
    print(summary_line(summary))
    return summary
