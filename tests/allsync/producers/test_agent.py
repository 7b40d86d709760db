"""Multi-turn tool agents: DeepSeek-V3's tool-call format, the calculator environment, the single rule that
builds rows (an observation that extends the row is appended with loss mask 0, a new context starts a new
segment), environment errors, and the config refusals."""

import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoTokenizer

from allsync.config import ConfigError, parse_config
from allsync.envs import EnvError
from allsync.envs.calculator import Calculator
from allsync.tasks.calculator import calculator_teacher_examples as teacher_examples, estimate
from allsync.envs.tool_calls import ToolCall, format_tool_calls, parse_tool_calls
from allsync.tasks import CalculatorGenerator, Problem, calculator_splits
from allsync.run.worker import RLWorker
from moe_lora.tiny import TinySpec, build_tokenizer, make_tiny

MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "a times b",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


def test_chat_template_writes_tool_calls_and_outputs_as_deepseek_v3():
    """The rendering of DeepSeek-V3-0324's template for the same conversation (its tool tokens, the call as
    type, sep, name and fenced JSON arguments, outputs closed before the final answer without a new turn)."""
    tokenizer = build_tokenizer(tool_tokens=True)
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 123 * 45?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "multiply", "arguments": '{"a": 123, "b": 45}'}}],
        },
        {"role": "tool", "content": "5535"},
        {"role": "assistant", "content": "Answer: 5535"},
    ]
    expected = (
        "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 123 * 45?<｜Assistant｜><｜tool▁calls▁begin｜>"
        '<｜tool▁call▁begin｜>function<｜tool▁sep｜>multiply\n```json\n{"a": 123, "b": 45}\n```<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜><｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>5535<｜tool▁output▁end｜>"
        "<｜tool▁outputs▁end｜>Answer: 5535<｜end▁of▁sentence｜>"
    )
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    assert expected.startswith(prompt) and prompt.endswith("<｜tool▁outputs▁end｜>")  # the answer follows the outputs
    ids = tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_tokens_to_ids("<｜tool▁sep｜>") in ids and len(tokenizer) == len(build_tokenizer()) + 9
    plain = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "x"},
    ]
    assert (
        tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
        == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>yo<｜end▁of▁sentence｜><｜User｜>x<｜Assistant｜>"
    )


def test_tool_calls_round_trip_and_errors():
    calls = [ToolCall("multiply", {"a": 347, "b": 29}), ToolCall("add", {"a": 1, "b": 2})]
    assert parse_tool_calls(format_tool_calls(calls)) == (calls, [])
    assert parse_tool_calls("Answer: 12") == ([], [])
    bad = format_tool_calls([ToolCall("multiply", {"a": 1, "b": 2})]).replace('{"a": 1, "b": 2}', "{a: 1}")
    assert parse_tool_calls(bad)[1][0].startswith("multiply: arguments are not JSON")
    assert parse_tool_calls("<｜tool▁calls▁begin｜>garbage")[1] == ["a tool-calls block without a well-formed call"]


def test_calculator_answers_calls_and_scores_the_answer():
    env = Calculator([MULTIPLY])
    assert env.reset({"prompt": "What is 347*29?", "answer": "10063"}) == [
        {"role": "user", "content": "What is 347*29?"}
    ]
    observation, reward, done = env.step(
        format_tool_calls([ToolCall("multiply", {"a": 347, "b": 29})]) + "<｜end▁of▁sentence｜>"
    )
    assert (observation, reward, done) == ([{"role": "tool", "content": "10063"}], 0.0, False)
    assert env.step(format_tool_calls([ToolCall("add", {"a": 1, "b": 2})]))[0] == [
        {"role": "tool", "content": "error: unknown tool 'add'"}
    ]
    assert env.step(format_tool_calls([ToolCall("multiply", {"a": "7", "b": 2})]))[0][0]["content"].startswith("error:")
    assert env.step("Answer: 10063") == (None, 1.0, True)
    assert env.step("Answer: 10000") == (None, 0.0, True)
    with pytest.raises(ValueError, match=r"producer.tools names \['divide'\]"):
        Calculator([{"type": "function", "function": {"name": "divide", "description": ""}}])


def test_calculator_teacher_calls_the_tool_at_its_rate():
    tokenizer = build_tokenizer(tool_tokens=True)
    problems = calculator_splits(CalculatorGenerator(), 400, 10).train
    examples = teacher_examples(tokenizer, problems, [MULTIPLY], tool_rate=0.3, seed=0)
    calls = sum("<｜tool▁calls▁begin｜>" in tokenizer.decode(ids[start:]) for ids, start in examples)
    assert len(examples) == len(problems) + calls and 0.24 < calls / len(problems) < 0.36
    for ids, start in examples:  # a tool output is never a target
        assert "<｜tool▁output▁begin｜>" not in tokenizer.decode(ids[start:])
    assert estimate(35424) == 35000 and estimate(10063) == 10000


class ScriptedEnv:
    """A test environment: the first reply gets a tool output (whatever it says), the second ends the episode
    with reward 1 if it is even-length; with new_context the second observation replaces the conversation."""

    def __init__(
        self,
        tools,
        new_context: bool = False,
        sleep: float = 0.0,
        fail: bool = False,
        bad: bool = False,
        never_done: bool = False,
        long_observation: str | None = None,
    ):
        self.new_context, self.sleep, self.fail, self.turn = new_context, sleep, fail, 0
        self.bad, self.never_done, self.long_observation = bad, never_done, long_observation

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        time.sleep(self.sleep)
        if self.fail:
            raise KeyError("boom")
        if self.bad:
            return [{"role": "robot", "content": 42}], 0.0, False
        self.turn += 1
        if self.never_done:
            return [{"role": "tool", "content": "again"}], 0.0, False
        if self.turn == 1 and self.long_observation:  # the role it is sent as
            return [{"role": self.long_observation, "content": "the output: " + "12 " * 100}], 0.0, False
        if self.turn == 1 and self.new_context:
            return [{"role": "user", "content": "Start over: " + text[:3], "new_context": True}], 0.0, False
        if self.turn == 1:
            return [{"role": "tool", "content": "42"}], 0.0, False
        return None, float(len(text) % 2 == 0), True


@pytest.fixture(scope="module")
def tiny_tools(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tools") / "tiny-tools", TinySpec(seed=0, tool_tokens=True))


def agent_config(
    base,
    env_kwargs_env="tests.allsync.producers.test_agent:ScriptedEnv",
    on_error="fail",
    timeout=10.0,
    observation_tokens=64,
):
    return parse_config(
        {
            "model": {"base": str(base), "quant": {"routed_experts": "nf4"}},
            "lora": {"rank": 4, "alpha": 8},
            "run": {"export": "merged"},
            "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 5},
            "algorithm": {"advantage": "drgrpo", "dynamic_sampling": False},
            "producer": {
                "kind": "agent",
                "env": env_kwargs_env,
                "tools": [MULTIPLY],
                "max_turns": 3,
                "max_observation_tokens": observation_tokens,
                "step_timeout_s": timeout,
            },
            "reward": {"on_error": on_error},
            "parallel": {"workers_per_node": 1},
        }
    )


PROBLEMS = [Problem("What is 2*3?", "6"), Problem("What is 4*5?", "20", {"env_kwargs": {"new_context": True}})]


def test_observations_extend_the_row_masked_and_a_new_context_starts_a_segment(tiny_tools):
    worker = RLWorker(agent_config(tiny_tools), PROBLEMS)
    try:
        torch.manual_seed(0)
        episodes, group_index, stats = worker.producer.collect(2, worker.policy.version)
        tokenizer = AutoTokenizer.from_pretrained(tiny_tools)
        output = tokenizer(
            "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>42<｜tool▁output▁end｜><｜tool▁outputs▁end｜>",
            add_special_tokens=False,
        )["input_ids"]
        for e in episodes[:2]:  # a tool output: one row, reply (trained), output (masked), reply (trained)
            (segment,) = e.segments
            mask = segment.loss_mask
            assert len(mask) == len(segment.response_ids) == len(segment.engine_logprobs)
            first = mask.index(0)
            observed = segment.response_ids[first : first + mask.count(0)]
            eos_added = observed[: len(observed) - len(output)]  # a reply cut at max_new_tokens gets its eos here
            assert observed[len(eos_added) :] == output and eos_added in ([], [tokenizer.eos_token_id])
            assert mask == [1] * first + [0] * len(observed) + [1] * (len(mask) - first - len(observed))
            assert e.info["observation_tokens"] == len(observed) and e.info["turns"] == 2
        for e in episodes[2:]:  # the environment started over: two segments, no masked token
            assert len(e.segments) == 2 and all(set(s.loss_mask) == {1} for s in e.segments)
            assert tokenizer.decode(e.segments[1].prompt_ids).startswith(
                "<｜begin▁of▁sentence｜># Tools\nmultiply: a times b\n<｜User｜>Start over: "
            )
        assert all(e.reward in (0.0, 1.0) and e.correct == (e.reward > 0) for e in episodes)
        metrics = worker.train(episodes, group_index)
        assert metrics["logprob_gap"] < 1e-3  # each row is exactly the context the engine replied in
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sleep": 60.0}, r"step took longer than producer.step_timeout_s = 0.5 s"),
        ({"fail": True}, r"step raised KeyError"),
        ({"bad": True}, r"malformed observation \[\{'role': 'robot', 'content': 42\}\]"),
    ],
)
def test_environment_errors_name_the_row_or_score_wrong(tiny_tools, kwargs, message):
    problems = [Problem("What is 2*3?", "6", {"env_kwargs": kwargs})]
    worker = RLWorker(agent_config(tiny_tools, timeout=0.5), problems)
    try:
        start = time.time()
        with pytest.raises(EnvError, match=r"on row 'What is 2\*3\?': " + message):
            worker.producer.collect(2, worker.policy.version)
        assert time.time() - start < 30  # the 60 s step was abandoned at its timeout: nothing hangs
    finally:
        worker.shutdown()
    worker = RLWorker(agent_config(tiny_tools, on_error="wrong", timeout=0.5), problems)
    try:
        episodes, _, _ = worker.producer.collect(2, worker.policy.version)
        assert all(e.reward == 0.0 and e.info["env_errors"] == 1 for e in episodes)
    finally:
        worker.shutdown()


def test_an_episode_past_max_turns_is_an_ordinary_wrong_outcome(tiny_tools):
    """A policy that keeps calling tools is not an environment error: even under reward.on_error fail the episode
    ends scored 0 and is counted (max_turns_reached), and the step goes on."""
    problems = [Problem("What is 2*3?", "6", {"env_kwargs": {"never_done": True}})]
    worker = RLWorker(agent_config(tiny_tools, on_error="fail"), problems)
    try:
        episodes, _, _ = worker.producer.collect(2, worker.policy.version)
        assert [(e.reward, e.info["max_turns_reached"], e.info["turns"], e.info["env_errors"]) for e in episodes] == [
            (0.0, 1, 3, 0)
        ] * 4
    finally:
        worker.shutdown()


HUNG_ENVIRONMENT = """
import threading
from allsync.producers.agent import Conversation, ToolAgent
from allsync.envs import EnvError

class Hung:
    def step(self, text):
        threading.Event().wait()  # never returns

agent = ToolAgent(None, None, Hung, [], None, 1, 1, 1, 0.3, "wrong", 4)
try:
    agent.call(Conversation(Hung(), {}, [], ""), "step", "x")
except EnvError as exc:
    print(exc)
"""


def test_a_process_exits_after_an_environment_call_hung_past_its_timeout():
    """The hung call is abandoned on a daemon thread: the process ends (before: Python joined the executor's
    thread at exit, and --no-ray or torchrun runs never exited)."""
    done = subprocess.run([sys.executable, "-c", HUNG_ENVIRONMENT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "step took longer than producer.step_timeout_s = 0.3 s"


@pytest.mark.parametrize(
    "role, closing", [("tool", "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"), ("user", "<｜Assistant｜>")]
)
def test_a_cut_observation_keeps_the_templates_closing_tokens_and_the_row(tiny_tools, role, closing):
    """An observation past producer.max_observation_tokens is cut in its content: the row keeps the template's closing
    tokens and the next assistant header, goes on as one row, and the trainer's logprobs equal the engine's."""
    problems = [Problem("What is 2*3?", "6", {"env_kwargs": {"long_observation": role}})]
    worker = RLWorker(agent_config(tiny_tools, observation_tokens=24), problems)
    tokenizer = AutoTokenizer.from_pretrained(tiny_tools)
    try:
        torch.manual_seed(0)
        episodes, group_index, stats = worker.producer.collect(2, worker.policy.version)
        for e in episodes:
            (segment,) = e.segments
            first = segment.loss_mask.index(0)
            observed = segment.response_ids[first : first + segment.loss_mask.count(0)]
            text = tokenizer.decode(observed)
            assert (
                len(observed) <= 24
                and e.info["observation_tokens"] == len(observed)
                and e.info["observations_cut"] == 1
            )
            assert text.endswith(closing) and "the output: 12 12" in text and text.count("12") < 100
            assert e.info["turns"] == 2
        assert worker.train(episodes, group_index)["logprob_gap"] < 1e-3
    finally:
        worker.shutdown()


def test_the_engines_context_holds_an_agents_longest_row(tiny_tools):
    """The engine's max_model_len counts the tool schemas, the earlier replies and observations: every row the
    agent builds (prompt + replies + observations) fits it, and a setting the checkpoint cannot hold is refused
    naming producer.max_turns (before: the first prompt without tools + rollout.max_new_tokens, overflowed by turn 2)."""
    config = agent_config(tiny_tools, observation_tokens=24)
    problems = [Problem("What is 2*3?", "6", {"env_kwargs": {"long_observation": "tool"}})]
    tokenizer = AutoTokenizer.from_pretrained(tiny_tools)
    model_len = config.producer.model_len(config, tokenizer, problems, 4096)
    first = len(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is 2*3?"}],
            tools=[MULTIPLY],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )
    assert model_len == first + 2 * (5 + 24) + 5  # 3 turns of 5 new tokens, 2 observations of at most 24
    worker = RLWorker(config, problems)
    try:
        episodes, _, _ = worker.producer.collect(2, worker.policy.version)
        assert all(len(s.prompt_ids) + len(s.response_ids) <= model_len for e in episodes for s in e.segments)
        assert (
            max(len(s.prompt_ids) + len(s.response_ids) for e in episodes for s in e.segments) > first + 5
        )  # past turn 1
    finally:
        worker.shutdown()
    with pytest.raises(
        ValueError,
        match=r"rollout.max_new_tokens = 5 plus the longest last-turn prompt \(the problem with "
        r"producer.tools, then producer.max_turns - 1 = 2 replies",
    ):
        config.producer.model_len(config, tokenizer, problems, model_len - 1)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"producer": {"env": "allsync.envs.calculator:Nope"}},
            r"producer.env: 'allsync.envs.calculator' has no class 'Nope'",
        ),
        ({"producer": {"tools": [{"name": "multiply"}]}}, r"producer.tools\[0\]: expected an OpenAI function schema"),
        ({"producer": {"max_turns": 0}}, r"producer.max_turns \(0\)"),
        ({"producer": {"memory_tokens": 4}}, r"producer.memory_tokens is set but producer.kind is agent"),
        (
            {"algorithm": {"advantage": "gae", "dynamic_sampling": False}},
            r"producer.kind agent with algorithm.advantage gae",
        ),
        (
            {"reward": {"name": "exact"}},
            r"reward.name / reward.function / reward.timeout_s / reward.length / algorithm.overlong with producer.kind agent",
        ),
        (
            {"reward": {"timeout_s": 3}},
            r"reward.timeout_s / reward.length / algorithm.overlong with producer.kind agent",
        ),
        ({"producer": None}, r"task.name calculator needs producer.kind agent"),
        ({"agent": {}}, r"'agent' has moved: write producer: \{kind: agent, env, tools"),
    ],
)
def test_agent_refusals_name_the_keys(change, message):
    data = {
        "task": {"name": "calculator"},
        "producer": {"kind": "agent", "env": "allsync.envs.calculator:Calculator", "tools": [MULTIPLY]},
    }
    for section, values in change.items():
        data[section] = None if values is None else {**data.get(section, {}), **values}
    data = {k: v for k, v in data.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        parse_config(data)


def test_agent_records_report_the_tool_call_rate():
    from allsync.producers.agent import Conversation, agent_records
    from evals.report import summarize_samples

    def conversation(calls: int, reward: float) -> Conversation:
        c = Conversation(
            None,
            {"prompt": "What is 2*3?", "answer": "6"},
            [{"role": "assistant", "content": f"Answer: {int(6 * reward)}"}],
            "",
        )
        c.reward, c.info["tool_calls"] = reward, calls
        return c

    records = agent_records(
        [conversation(1, 1.0), conversation(0, 0.0), conversation(2, 1.0), conversation(0, 0.0)], [0, 1], 2
    )
    assert [r.problem_id for r in records] == [0, 0, 1, 1] and [r.answer for r in records] == ["6", "0", "6", "0"]
    summary = summarize_samples(records, 2)
    assert summary["tool_call_rate"] == 0.5 and summary["avg@2"] == 0.5


def test_calls_still_running_past_the_cap_stop_the_run_naming_the_environment():
    """A spinning environment keeps each abandoned thread (and maybe a core) for the rest of the run: at most
    producer.max_abandoned_calls may run at once; one more stops the run even under reward.on_error wrong. A call
    that finishes late frees its place."""
    import threading

    from allsync.producers.agent import AbandonedCallsError, CallTimeout, Conversation, DaemonCaller, ToolAgent

    release = threading.Event()
    caller = DaemonCaller("Spinning", max_abandoned=2)
    for _ in range(2):  # two hung calls: abandoned, under the cap
        with pytest.raises(CallTimeout):
            caller(release.wait, (), 0.05)
    with pytest.raises(AbandonedCallsError, match=r"environment Spinning: 3 calls are still running .* = 2"):
        caller(release.wait, (), 0.05)
    release.set()  # the hung calls return: their threads end
    for t in caller.abandoned:
        t.join(timeout=5)
    late = DaemonCaller("Late", max_abandoned=1)
    with pytest.raises(CallTimeout):
        late(time.sleep, (0.2,), 0.05)  # abandoned, then returns
    late.abandoned[0].join(timeout=5)
    with pytest.raises(CallTimeout):
        late(time.sleep, (0.2,), 0.05)  # the finished one no longer counts: 1 running, at the cap, not past it
    assert late(lambda: 7, (), 5.0) == 7
    agent = ToolAgent(None, None, type("Spinning", (), {}), [], None, 1, 1, 1, 0.05, "wrong", max_abandoned_calls=0)

    class Spin:
        def step(self, text):
            release.clear()
            release.wait()

    with pytest.raises(AbandonedCallsError, match="environment Spinning"):  # not turned into the row's EnvError
        agent.call(Conversation(Spin(), {}, [], ""), "step", "x")
    release.set()
