"""The prompts of a multi-conversation episode (producer.kind multiconv; allsync/producers/multiconv.py): a question,
the memory so far and a chunk of the input in each conversation, the memory alone in the last, rendered with the
chat template and the memory's and chunk's token ids put in place (never re-encoded). The memory_recall task's
teacher writes its examples in the same layout (allsync/tasks/memory_recall.py)."""

from __future__ import annotations

from allsync.tasks.problems import Problem, chat_messages

MEMORY_OPEN, MEMORY_CLOSE = "<memory>", "</memory>"
SLOT = "\u2063MEMORY\u2063"  # where the memory's token ids go in a rendered prompt (an invisible separator around it)
CHUNK_SLOT = "\u2063CHUNK\u2063"  # where the chunk's token ids go


def memory_prompt_text(question: str, with_chunk: bool) -> str:
    """The user turn of a memory write (with_chunk) or of the final answer, with the slots for ids."""
    if not with_chunk:
        return f"{question}\nMemory: {SLOT}\nAnswer:"
    return f"{question}\nMemory: {SLOT}\nText: {CHUNK_SLOT}\nNew memory:"


def conversation_messages(question: str | tuple[tuple[str, str], ...], with_chunk: bool) -> list[dict[str, str]]:
    """The question as chat messages (a text is one user message; a dataset row's (role, content) messages keep
    their roles), its last user turn holding the memory's (and the chunk's) slots."""
    messages = chat_messages(Problem(question, ""))
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        raise ValueError(f"problem {question!r}: multi-conversation needs a user message to put the memory in")
    messages[users[-1]] = {"role": "user", "content": memory_prompt_text(messages[users[-1]]["content"], with_chunk)}
    return messages


def conversation_ids(
    tokenizer, question: str | tuple[tuple[str, str], ...], chunk: list[int] | None, memory: list[int]
) -> list[int]:
    """The chat-template prompt of one conversation with the memory's and the chunk's token ids in place
    (never re-encoded); chunk None: the final answer's conversation."""
    rendered = tokenizer.apply_chat_template(
        conversation_messages(question, chunk is not None), add_generation_prompt=True, tokenize=False
    )
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    before, after = rendered.split(SLOT)
    if chunk is None:
        return encode(before) + memory + encode(after)
    middle, after = after.split(CHUNK_SLOT)
    return encode(before) + memory + encode(middle) + chunk + encode(after)


def chunk_ids(tokenizer, problem: Problem, chunk_tokens: int | None) -> list[list[int]]:
    """The problem's chunks as token ids: its metadata's chunk texts, or its context cut every chunk_tokens."""
    metadata = problem.metadata or {}
    if "chunks" in metadata:
        return [tokenizer(c, add_special_tokens=False)["input_ids"] for c in metadata["chunks"]]
    if "context" in metadata and chunk_tokens:
        ids = tokenizer(metadata["context"], add_special_tokens=False)["input_ids"]
        return [ids[i : i + chunk_tokens] for i in range(0, len(ids), chunk_tokens)]
    raise ValueError(
        f"problem {problem.prompt!r}: multi-conversation needs metadata chunks, or a context with producer.chunk_tokens"
    )


def longest_conversation_tokens(
    tokenizer, problems: list[Problem], memory_tokens: int, chunk_tokens: int | None
) -> int:
    """Tokens of the longest conversation prompt: the question whose rendered conversation has the most tokens, with
    a full memory and the chunk with the most tokens (the answer's prompt has no chunk, so it is shorter). Every
    question and chunk is measured in tokens: a shorter text can have more of them."""
    questions = list(dict.fromkeys(p.prompt for p in problems)) or [""]
    longest_question = max(len(conversation_ids(tokenizer, q, [], [])) for q in questions)
    if chunk_tokens:
        longest_chunk = chunk_tokens
    else:
        chunks = list({c for p in problems for c in p.metadata["chunks"]})
        ids = tokenizer(chunks, add_special_tokens=False)["input_ids"] if chunks else []  # one batch call
        longest_chunk = max(map(len, ids), default=0)
    return longest_question + memory_tokens + longest_chunk
