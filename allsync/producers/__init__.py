"""Episode producers: each turns problems into episodes (allsync.episodes) with the rollout engine.

    single_turn.py  one prompt, group_size answers (DAPO, GRPO, Dr.GRPO)
    multiconv.py    multi-conversation DAPO: chunks read one at a time, a memory carried between them
    windows.py      T-PPO: responses generated a window of tokens per step, trained with a critic
    groups.py       dynamic sampling (keep groups whose metric varies, refill) around any group producer

The update (allsync/learner.py) consumes episodes and never knows which producer made them.
"""


def engine_model_len(config, tokenizer, problems: list, max_position_embeddings: int) -> int:
    """The longest sequence the run's producer can build, which the rollout engine's context must hold
    (allsync.tasks.model_len_needed; ValueError naming the settings when the checkpoint cannot):
        single turn, T-PPO windows: longest prompt + rollout.max_new_tokens
        multi-conversation:          longest memory write's prompt (question, a full memory, the longest chunk)
                                     + max(rollout.max_new_tokens, rollout.memory_tokens): a write may use memory_tokens
        tool agent:                  its last turn's prompt (the problem with agent.tools, then max_turns - 1 replies
                                     and observations) + rollout.max_new_tokens."""
    from allsync.tasks import longest_prompt_tokens, model_len_needed

    r = config.rollout
    if config.agent is not None:
        from allsync.producers.agent import longest_last_turn_prompt

        a = config.agent
        longest = longest_last_turn_prompt(tokenizer, problems, a.tools, a.max_turns, r.max_new_tokens, a.max_observation_tokens)
        return model_len_needed(longest, r.max_new_tokens, max_position_embeddings, prompt_name=(
            f"the longest last-turn prompt (the problem with agent.tools, then agent.max_turns - 1 = {a.max_turns - 1} replies "
            f"of rollout.max_new_tokens and observations of agent.max_observation_tokens = {a.max_observation_tokens})"))  # fmt: skip
    if config.algorithm.multiconv is not None:
        from allsync.producers.multiconv import longest_conversation_tokens

        longest = longest_conversation_tokens(tokenizer, problems, r.memory_tokens, r.chunk_tokens)
        new_tokens, name = max((r.max_new_tokens, "rollout.max_new_tokens"), (r.memory_tokens, "rollout.memory_tokens"))
        return model_len_needed(longest, new_tokens, max_position_embeddings, name,
                                "the longest memory write's prompt (question, rollout.memory_tokens of memory, the longest chunk)")  # fmt: skip
    return model_len_needed(longest_prompt_tokens(tokenizer, problems), r.max_new_tokens, max_position_embeddings)
