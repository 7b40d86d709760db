"""Multi-conversation DAPO in the loop: memory extraction, memory passed on as token ids, whole episodes in
the update (one advantage per episode, credit rule, episode token counts), the memory_recall task and its
noisy teacher, and the config refusals."""

import random

import pytest
import torch
from transformers import AutoTokenizer

from allsync.config import ConfigError, OverlongSection, parse_config
from allsync.episodes import Episode, Segment, flatten
from allsync.producers.multiconv import extract_memory, find_ids
from allsync.tasks.conversations import MEMORY_CLOSE, MEMORY_OPEN, conversation_ids
from allsync.tasks.memory_recall import memory_teacher_examples as teacher_examples
from allsync.tasks import MemoryRecallGenerator, memory_recall_problem, memory_recall_splits
from allsync.run.worker import RLWorker

OPEN, CLOSE, EOS = [7, 8], [9], 1


def test_find_ids_matches_whole_tokens_only():
    assert find_ids([5, 7, 8, 3], [7, 8]) == 1
    assert find_ids([5, 7, 8, 3, 7, 8], [7, 8], 2) == 4
    assert find_ids([256 * 7, 8], [7]) == -1  # 7's bytes occur inside 1792's, not on a token boundary
    assert find_ids([1, 2], [1, 2, 3]) == -1 and find_ids([1, 2], []) == -1


@pytest.mark.parametrize(
    "response, reason, expected",
    [
        ([7, 8, 20, 21, 9, EOS], "stop", ([20, 21], "ok")),
        ([30, 7, 8, 20, 9, 40, EOS], "stop", ([20], "ok")),  # text around the tags is not memory
        ([7, 8, 20, 21, 22], "length", ([20, 21, 22], "truncated")),  # cut at memory_tokens: passed on as it is
        ([7, 8, 20, EOS], "stop", ([20], "malformed")),  # ended without a closing tag
        ([20, 21, EOS], "stop", ([], "malformed")),  # no opening tag: an empty memory
    ],
)
def test_extract_memory(response, reason, expected):
    assert extract_memory(response, OPEN, CLOSE, EOS, reason) == expected


def test_memory_recall_problems_need_the_first_chunk():
    spec = MemoryRecallGenerator(chunks=3, per_chunk=3)
    p = memory_recall_problem(random.Random(1), spec)
    letter = p.prompt.split("what is ")[1].rstrip("?")
    assert (
        p.metadata["gold_memory"] == f"{letter}={p.answer}"
        and p.metadata["gold_memory"] in p.metadata["chunks"][0].split()
    )
    assert all(not c.startswith(f"{letter}=") for chunk in p.metadata["chunks"][1:] for c in chunk.split())
    assert p.metadata["decoy_memory"] == p.metadata["chunks"][-1].split()[-1]
    splits = memory_recall_splits(spec, 300, 50, seed=0)
    held = {tuple(q.metadata["chunks"]) for q in splits.heldout}
    assert len(held) == 50 and not any(tuple(q.metadata["chunks"]) in held for q in splits.train)


def test_teacher_keeps_the_decoy_at_its_rate(tiny_bf16):
    tokenizer = AutoTokenizer.from_pretrained(tiny_bf16)
    problems = memory_recall_splits(MemoryRecallGenerator(), 400, 10, seed=0).train
    examples = teacher_examples(tokenizer, problems, decoy_rate=0.25, seed=0)
    assert len(examples) == 3 * len(problems)  # two memory writes and the answer
    replies = [tokenizer.decode(ids[start:], skip_special_tokens=False) for ids, start in examples]
    assert replies[0] == f"{MEMORY_OPEN}{problems[0].metadata['gold_memory']}{MEMORY_CLOSE}{tokenizer.eos_token}"
    decoys = sum(problems[i].metadata["decoy_memory"] in replies[3 * i + 1] for i in range(len(problems)))
    assert 0.18 < decoys / len(problems) < 0.32
    for i, p in enumerate(problems):  # the answer reads the memory the teacher wrote
        memory = (
            p.metadata["decoy_memory"]
            if p.metadata["decoy_memory"] in replies[3 * i + 1]
            else p.metadata["gold_memory"]
        )
        assert replies[3 * i + 2] == f"Answer: {memory.split('=')[1]}{tokenizer.eos_token}"


def test_the_single_context_form_reads_the_same_problems_in_one_prompt(tiny_bf16):
    """task.context single: the segmented form's problems with the chunks, one a line, before the question; its
    teacher answers the decoy's value at the segmented teacher's rate; the warm start's settings name the form only
    when it is single (bases built before it stay valid)."""
    from allsync.config import load_config_for_planning  # noqa: F401 - the config package registers the tasks
    from allsync.warm_start import settings_for_run

    tokenizer = AutoTokenizer.from_pretrained(tiny_bf16)
    segmented = memory_recall_splits(MemoryRecallGenerator(asked_first=True), 400, 20, seed=3)
    single = MemoryRecallGenerator(asked_first=True, context="single").splits(400, 20, seed=3)
    for a, b in zip(segmented.heldout + segmented.train, single.heldout + single.train):
        assert b.prompt == "\n".join([*a.metadata["chunks"], a.prompt]) and (b.answer, b.metadata) == (
            a.answer,
            a.metadata,
        )
    generator = MemoryRecallGenerator(context="single", teacher_decoy_rate=0.25)
    examples = generator.teacher_examples(tokenizer, single.train, seed=0)
    replies = [tokenizer.decode(ids[start:], skip_special_tokens=True) for ids, start in examples]
    decoys = [r == f"Answer: {p.metadata['decoy_memory'].split('=')[1]}" for r, p in zip(replies, single.train)]
    gold = [r == f"Answer: {p.answer}" for r, p in zip(replies, single.train)]
    assert all(d or g for d, g in zip(decoys, gold)) and 0.18 < sum(decoys) / len(decoys) < 0.32
    prompts = generator.heldout_prompts(tokenizer, single.heldout[:2])
    assert "Question: what is" in tokenizer.decode(prompts[0]) and single.heldout[0].metadata["chunks"][
        1
    ] in tokenizer.decode(prompts[0])

    def task_settings(context):
        config = parse_config(
            {
                "model": {"base": str(tiny_bf16)},
                "rollout": {"prompts_per_step": 2, "max_new_tokens": 12},
                "task": {"name": "memory_recall", "context": context},
                **({"producer": {"kind": "multiconv", "memory_tokens": 8}} if context == "segments" else {}),
            }
        )
        return settings_for_run(config).as_json()["task"]

    assert "context" not in task_settings("segments") and task_settings("single")["context"] == "single"


def memory_config(base, **multiconv):
    return parse_config(
        {
            "model": {"base": str(base), "quant": {"routed_experts": "nf4"}},
            "lora": {"rank": 4, "alpha": 8},
            "run": {"export": "merged"},
            "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6},
            "producer": {"kind": "multiconv", "memory_tokens": 5, **multiconv},
            "algorithm": {"advantage": "drgrpo", "dynamic_sampling": False},
            "task": {"name": "memory_recall"},
            "parallel": {"workers_per_node": 1},
        }
    )


def test_memory_is_passed_on_as_the_engines_token_ids(tiny_bf16):
    """Each memory write's ids (between the tags, or everything after the opening tag when cut) sit
    unchanged inside the next conversation's prompt; engine and trainer logprobs agree on every segment."""
    problems = memory_recall_splits(MemoryRecallGenerator(), 8, 2, seed=0).train
    worker = RLWorker(memory_config(tiny_bf16), problems)
    try:
        torch.manual_seed(0)
        episodes, group_index, stats = worker.producer.collect(2, worker.policy.version)
        assert len(episodes) == 4 and all(len(e.segments) == 3 for e in episodes)
        assert [s.kind for s in episodes[0].segments] == ["memory", "memory", "answer"]
        open_ids, close_ids = worker.producer.producer.open_ids, worker.producer.producer.close_ids
        eos = worker.tokenizer.eos_token_id
        for e in episodes:
            problem = problems[0] if e in episodes[:2] else problems[1]
            first_chunk = worker.tokenizer(problem.metadata["chunks"][0], add_special_tokens=False)["input_ids"]
            assert e.segments[0].prompt_ids == conversation_ids(worker.tokenizer, problem.prompt, first_chunk, [])
            for before, after in zip(e.segments, e.segments[1:]):
                memory, _ = extract_memory(before.response_ids, open_ids, close_ids, eos, before.finish_reason)
                assert find_ids(after.prompt_ids, memory) != -1 if memory else True
                assert len(before.response_ids) <= 5  # rollout.memory_tokens
        metrics = worker.train(episodes, group_index)
        assert metrics["logprob_gap"] < 1e-3
        assert metrics["logprob_gap_memory_tokens"] > 0 and metrics["logprob_gap_answer_tokens"] > 0
    finally:
        worker.shutdown()


def test_old_logprobs_from_the_engine_keep_every_segments_gap(tiny_bf16):
    """algorithm.old_logprobs engine with two minibatches: the torch engine's logprobs of every segment are the old
    ones (no no-gradient pass), and the per-segment gaps come from the first minibatch's forward against them."""
    problems = memory_recall_splits(MemoryRecallGenerator(), 8, 2, seed=0).train
    config = memory_config(tiny_bf16)
    config.optim.minibatches, config.algorithm.old_logprobs = 2, "engine"
    worker = RLWorker(config, problems)
    try:
        torch.manual_seed(0)
        episodes, group_index, _ = worker.producer.collect(2, worker.policy.version)
        worker.learner.passes.current_logprobs = lambda *a: pytest.fail(
            "no old-logprob forward with old_logprobs engine"
        )
        metrics = worker.train(episodes, group_index)
        assert metrics["optimizer_steps"] == 2 and metrics["logprob_gap"] < 1e-3
        assert metrics["logprob_gap_memory_tokens"] > 0 and metrics["logprob_gap_answer_tokens"] > 0
        assert metrics["logprob_gap_memory_sum"] / metrics["logprob_gap_memory_tokens"] < 1e-3
    finally:
        worker.shutdown()


def synthetic_episodes():
    """The oracle's P1: rewards [1, 0], response tokens [4, 6, 2] and [3, 3, 3] (memory, memory, answer)."""
    episodes = []
    for reward, lengths in ((1.0, (4, 6, 2)), (0.0, (3, 3, 3))):
        segments = [
            Segment([0, 3, 40 + k], list(range(50, 50 + n)), [0.0] * n, "stop", kind, 0)
            for k, (n, kind) in enumerate(zip(lengths, ("memory", "memory", "answer")))
        ]
        episodes.append(Episode(segments, reward, bool(reward)))
    return episodes, torch.tensor([0, 0])


@pytest.mark.parametrize("credit, weighting", [("all", "token"), ("final", "token"), ("all", "episode")])
def test_episode_batch_spreads_one_advantage_over_the_segments(tiny_bf16, credit, weighting):
    episodes, group_index = synthetic_episodes()
    worker = RLWorker(memory_config(tiny_bf16, credit=credit, weighting=weighting), [])
    try:
        tb = worker.learner.batches.episode_batch(episodes, group_index)
        mask = tb.sequences.response_mask
        assert tb.episode_of_row.tolist() == [0, 0, 0, 1, 1, 1]
        trained = mask.sum(-1).tolist()
        assert trained == ([4, 6, 2, 3, 3, 3] if credit == "all" else [0, 0, 2, 0, 0, 3])
        assert tb.episode_tokens.tolist() == ([12] * 3 + [9] * 3 if credit == "all" else [2] * 3 + [3] * 3)
        on_tokens = tb.advantages[mask != 0]
        assert sorted(set(on_tokens.tolist())) == [-0.5, 0.5]  # Dr.GRPO: one number per episode
        assert (tb.advantages[:3][mask[:3] != 0] == 0.5).all()
        assert (
            worker.learner.loss_settings.agg == {"token": "token-mean", "episode": "episode-mean-token-mean"}[weighting]
        )
        assert tb.counts(torch.arange(6)).tolist() == [sum(trained), 2.0, 0.0]
        assert [r.tolist() for r in tb.minibatch_rows(2)] == [[0, 1, 2], [3, 4, 5]]  # whole episodes only
    finally:
        worker.shutdown()


def test_a_worker_with_no_trained_token_computes_no_gap(tiny_bf16):
    """credit final and every answer cut at the token budget (the overlong filter masks both episodes): one minibatch
    trains no token, the update computed no logprobs, and the per-kind gaps count no token (not |engine - 0|)."""
    episodes, group_index = synthetic_episodes()
    for e in episodes:
        e.segments[-1].finish_reason = "length"
    config = memory_config(tiny_bf16, credit="final")
    config.algorithm.overlong = OverlongSection(max_len=6, cache_len=2, filter_truncated=True)
    worker = RLWorker(config, [])
    try:
        out = worker.train(episodes, group_index)
        assert out["optimizer_steps"] == 0 and out["empty_minibatches"] == 1 and out["trained_tokens"] == 0
        assert out["logprob_gap_memory_tokens"] == out["logprob_gap_answer_tokens"] == 0.0
        assert out["logprob_gap_memory_sum"] == out["logprob_gap_answer_sum"] == 0.0
        # another worker has 10 trained tokens in its episode (its share of the counts' all-reduce): this one's
        # minibatch runs no forward, so it has no logprobs to compare (it had |engine - 0| over 15 tokens before)
        all_reduce, calls = worker.learner.all_reduce, []

        def with_another_workers_counts(tensor, group="world"):
            calls.append(group)
            if len(calls) == 1:
                tensor += torch.tensor([[10.0, 1.0, 0.0]], dtype=tensor.dtype)
            return all_reduce(tensor, group)

        worker.learner.all_reduce = with_another_workers_counts
        out = worker.train(episodes, group_index)
        assert out["optimizer_steps"] == 1 and out["trained_tokens"] == 0
        assert out["logprob_gap_memory_tokens"] == out["logprob_gap_answer_tokens"] == 0.0
    finally:
        worker.shutdown()


def test_a_context_is_cut_into_chunks_of_token_ids(tiny_bf16):
    """MemAgent's reading of a long document: the context's ids cut every chunk_tokens, placed in the prompt as
    they are (a chunk boundary may split a word: its ids are never re-encoded)."""
    from allsync.tasks.conversations import chunk_ids
    from allsync.tasks import Problem

    tokenizer = AutoTokenizer.from_pretrained(tiny_bf16)
    context = "The capital of France is Paris. " * 3
    problem = Problem("Question: what is the capital of France?", "Paris", {"context": context})
    chunks = chunk_ids(tokenizer, problem, 10)
    ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    assert [len(c) for c in chunks] == [10] * (len(ids) // 10) + ([len(ids) % 10] if len(ids) % 10 else [])
    assert sum(chunks, []) == ids
    prompt = conversation_ids(tokenizer, problem.prompt, chunks[1], [5, 6])
    memory_at = find_ids(prompt, [5, 6])
    assert (
        memory_at > 0 and find_ids(prompt, chunks[1], memory_at + 2) > memory_at
    )  # the chunk's ids follow the memory's
    with pytest.raises(ValueError, match="needs metadata chunks, or a context with producer.chunk_tokens"):
        chunk_ids(tokenizer, Problem("q", "a"), 10)


def test_flatten_marks_answers_and_truncated_episodes():
    episodes, _ = synthetic_episodes()
    episodes[1].final.finish_reason = "length"
    rows = flatten(episodes)
    assert rows.is_answer == [False, False, True] * 2
    assert rows.truncated_episode == [False] * 3 + [True] * 3


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"algorithm": {"advantage": "egae", "dynamic_sampling": False}},
            r"producer.kind multiconv with algorithm.advantage egae",
        ),
        ({"producer": {"window": 4}}, r"producer.window is set but producer.kind is multiconv, which does not use it"),
        ({"producer": {"credit": "some"}}, r"producer.credit = 'some'"),
        ({"producer": {"weighting": "seq"}}, r"producer.weighting = 'seq'"),
        (
            {"algorithm": {"loss_agg": "seq-mean-token-mean"}},
            r"algorithm.loss_agg = seq-mean-token-mean with producer.kind multiconv",
        ),
        ({"producer": {"memory_tokens": None}}, r"needs producer.memory_tokens"),
        (
            {"producer": {"kind": "single_turn", "memory_tokens": None}},
            r"task.name memory_recall needs producer.kind multiconv",
        ),
        (
            {"producer": {"kind": "single_turn"}, "task": {"name": "arithmetic"}},
            r"producer.memory_tokens is set but producer.kind is single_turn",
        ),
        ({"task": {"name": "arithmetic"}}, r"producer.kind multiconv with task.name arithmetic"),
        (
            {"task": {"context": "single"}},
            r"task.name memory_recall needs producer.kind single_turn \(task.context single reads each problem",
        ),
        ({"task": {"context": "one"}}, r"memory_recall: context = 'one': use one of segments, single"),
        ({"producer": {"chunk_tokens": 16}}, r"producer.chunk_tokens = 16 with task.name memory_recall"),
        (
            {"rollout": {"memory_tokens": 8}},
            r"'rollout.memory_tokens' has moved: write producer: \{kind: multiconv, memory_tokens: N\}",
        ),
        ({"algorithm": {"multiconv": {}}}, r"'algorithm.multiconv' has moved"),
    ],
)
def test_refusals_name_the_keys(change, message):
    data = {
        "rollout": {"prompts_per_step": 2},
        "producer": {"kind": "multiconv", "memory_tokens": 8},
        "task": {"name": "memory_recall"},
    }
    for section, values in change.items():
        data[section] = {**data.get(section, {}), **values}
    data["producer"] = {k: v for k, v in data["producer"].items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        parse_config(data)


def test_a_message_list_prompt_is_rendered_through_the_chat_template(tiny_bf16):
    """verl's layout: `prompt` is a list of messages. Each conversation renders them with the chat template (the
    system message in its place, the memory and chunk in the last user turn), never as a Python tuple's repr."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_bf16)
    question = (("system", "Read carefully."), ("user", "Question: what is a?"))
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    chunk, memory = encode("a = 5"), encode("b = 2")
    text = tokenizer.decode(conversation_ids(tokenizer, question, chunk, memory))
    assert text == (
        "<｜begin▁of▁sentence｜>Read carefully.<｜User｜>Question: what is a?\nMemory: b = 2\nText: a = 5\n"
        "New memory:<｜Assistant｜>"
    )
    assert tokenizer.decode(conversation_ids(tokenizer, question, None, memory)).endswith(
        "<｜User｜>Question: what is a?\nMemory: b = 2\nAnswer:<｜Assistant｜>"
    )
    with pytest.raises(ValueError, match="needs a user message"):
        conversation_ids(tokenizer, (("system", "no question"),), chunk, memory)


def test_the_engines_context_holds_a_memory_write_longer_than_max_new_tokens(tiny_bf16):
    """A memory write may use producer.memory_tokens new tokens: with memory_tokens > max_new_tokens the context is
    the longest write's prompt + memory_tokens (before: + max_new_tokens, and vLLM cut the write silently)."""
    from allsync.config import parse_config
    from allsync.tasks.conversations import longest_conversation_tokens
    from allsync.tasks import MemoryRecallGenerator, memory_recall_splits

    config = parse_config(
        {
            "task": {"name": "memory_recall"},
            "producer": {"kind": "multiconv", "memory_tokens": 40},
            "rollout": {"max_new_tokens": 8},
        }
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_bf16)
    problems = memory_recall_splits(MemoryRecallGenerator(2, 3), 20, 5).train
    longest = longest_conversation_tokens(tokenizer, problems, 40, None)
    assert config.producer.model_len(config, tokenizer, problems, 4096) == longest + 40
    with pytest.raises(ValueError, match=r"producer.memory_tokens = 40 plus the longest memory write's prompt"):
        config.producer.model_len(config, tokenizer, problems, longest + 39)


def test_the_longest_conversation_is_counted_in_tokens_not_characters(tiny_bf16):
    """A question of fewer characters but more tokens (the tiny tokenizer spends 3 byte tokens on a euro sign, 1 on
    a letter) and a chunk likewise: the context is sized by the one with the most tokens."""
    from allsync.tasks.conversations import longest_conversation_tokens
    from allsync.tasks import Problem

    tokenizer = AutoTokenizer.from_pretrained(tiny_bf16)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    wordy, dense = "the " * 10, "€" * 20
    assert len(wordy) > len(dense) and len(encode(wordy)) < len(encode(dense))
    problems = [
        Problem(wordy, "1", {"chunks": [wordy, "a"]}),
        Problem(dense, "2", {"chunks": ["b", dense]}),
    ]
    want = len(conversation_ids(tokenizer, dense, [], [])) + 7 + len(encode(dense))
    assert longest_conversation_tokens(tokenizer, problems, 7, None) == want
    assert longest_conversation_tokens(tokenizer, problems, 7, 5) == want - len(encode(dense)) + 5


def test_producers_without_a_memory_refuse_the_memory_ablation():
    from allsync.producers.registry import refuse_memory_ablation
    from allsync.producers.single_turn import engine_answers

    refuse_memory_ablation("own")
    with pytest.raises(ValueError, match=r"memory 'gold': only multi-conversation episodes .* carry a memory"):
        engine_answers(None, None, [], 1, None, memory="gold")  # refused before the engine is asked
