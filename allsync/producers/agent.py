"""Multi-turn tool agents (producer.kind agent): an environment (allsync.envs) answers each reply until it says done.

Per episode: messages = env.reset(row); the chat template renders them with the tools; the engine
replies; env.step(reply) returns observation messages, a reward and done. One rule builds the rows:
a next prompt whose text extends the current row's text (prompt + replies + observations so far) is
appended to the same row, its new tokens (the observations) with loss mask 0; a prompt that does not
extend it (the environment reset the context, as a memory agent does) starts a new segment. The
engine's own reply ids are never re-encoded, so their logprobs stay valid. The reward at done trains
every reply token of every segment (allsync/update/learner.py).

Errors (an environment that raises, takes longer than producer.step_timeout_s or returns a malformed observation)
are reported with the episode's row; with reward.on_error fail the step stops, with wrong the episode ends
scored 0. Environment calls run on a daemon thread: a call past its timeout is abandoned there, and the process
can still exit; more than producer.max_abandoned_calls such calls still running stops the run, naming the environment. An episode still going after producer.max_turns replies is an ordinary outcome: it ends scored 0
(`max_turns_reached`). An observation longer than producer.max_observation_tokens is cut in its messages' content
and rendered again, so the row keeps the template's closing tokens and the next assistant header.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import ClassVar

from allsync.algorithms import estimators_that
from allsync.envs import EnvError, check_observation
from allsync.envs.tool_calls import parse_tool_calls
from allsync.episodes import Episode, Segment
from allsync.producers.groups import GroupRounds
from allsync.producers.registry import ProducerContext, ProducerDefaults, refuse_memory_ablation, register_producer
from allsync.engines.torch_engine import Sampling
from allsync.tasks import Problem, chat_messages, model_len_needed, reward_row


def longest_last_turn_prompt(
    tokenizer,
    problems: list[Problem],
    tools: list[dict],
    max_turns: int,
    max_new_tokens: int,
    max_observation_tokens: int,
) -> int:
    """Tokens of the longest prompt an agent's last turn can have: the longest problem rendered as a user message
    with the tool schemas, then max_turns - 1 replies of at most max_new_tokens and observations of at most
    max_observation_tokens. (An environment whose reset adds messages beyond the problem's makes it longer.)"""
    texts = {p.prompt: p for p in problems}.values()
    first = max(
        (
            len(
                tokenizer.apply_chat_template(
                    chat_messages(p), tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            )
            for p in texts
        ),
        default=0,
    )
    return first + (max_turns - 1) * (max_new_tokens + max_observation_tokens)


@dataclass
class Conversation:
    """One episode in progress."""

    env: object
    row: dict
    messages: list[dict]
    text: str  # the current row's text: its prompt, replies and observations so far
    segments: list[Segment] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict = field(
        default_factory=lambda: {
            "turns": 0,
            "tool_calls": 0,
            "tool_errors": 0,
            "observation_tokens": 0,
            "observations_cut": 0,
            "env_errors": 0,
            "max_turns_reached": 0,
        }
    )


class CallTimeout(Exception):
    """A DaemonCaller call passed its timeout (its own class: a TimeoutError the environment raises is an error)."""


class AbandonedCallsError(RuntimeError):
    """Too many environment calls still running past their timeout: each may hold a core for the rest of the run."""


class DaemonCaller:
    """Calls run one at a time on a daemon thread, each with a timeout. A call past it keeps that thread, which is
    abandoned (a daemon thread never holds the process at exit) and replaced by a fresh one for later calls. An
    abandoned call that never returns (a spinning environment) burns a core until the process ends, so at most
    `max_abandoned` may be running at once: one more raises AbandonedCallsError, which stops the run whatever
    reward.on_error says (`name`: the environment, for the message)."""

    def __init__(self, name: str, max_abandoned: int):
        self.name, self.max_abandoned = name, max_abandoned
        self.abandoned: list[threading.Thread] = []
        self._start()

    def _start(self) -> None:
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, args=(self.requests,), name="agent-env", daemon=True)
        self.thread.start()

    def _abandon(self) -> None:
        """The current thread passed its timeout: told to end once its call returns, counted while it runs, and
        replaced by a fresh one; past the cap, the run stops."""
        self.requests.put(None)  # its loop ends after the hung call, if that ever returns
        self.abandoned = [t for t in self.abandoned if t.is_alive()] + [self.thread]
        if len(self.abandoned) > self.max_abandoned:
            raise AbandonedCallsError(
                f"environment {self.name}: {len(self.abandoned)} calls are still running past producer.step_timeout_s "
                f"(more than producer.max_abandoned_calls = {self.max_abandoned}); each may hold a core for the rest "
                "of the run, so the run stops: make reset / step return within the timeout"
            )
        self._start()

    @staticmethod
    def _serve(requests: queue.SimpleQueue) -> None:
        while (request := requests.get()) is not None:
            fn, args, reply = request
            try:
                reply.put((True, fn(*args)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, which reports it with its row
                reply.put((False, exc))

    def __call__(self, fn, args: tuple, timeout: float):
        """fn(*args); CallTimeout past `timeout` seconds; what fn raises is raised here."""
        reply: queue.SimpleQueue = queue.SimpleQueue()
        self.requests.put((fn, args, reply))
        try:
            ok, value = reply.get(timeout=timeout)
        except queue.Empty:
            self._abandon()
            raise CallTimeout from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self.requests.put(None)


class ToolAgent:
    def __init__(
        self,
        engine,
        tokenizer,
        env_class,
        tools: list[dict],
        sampling: Sampling,
        group_size: int,
        max_turns: int,
        max_observation_tokens: int,
        step_timeout_s: float,
        on_error: str,
        max_abandoned_calls: int,
    ):
        """Under expert parallelism every rank takes a turn while any rank has an active conversation (the
        engine's agreed_rounds)."""
        self.engine, self.tokenizer, self.env_class, self.tools = engine, tokenizer, env_class, tools
        self.sampling, self.group_size, self.max_turns = sampling, group_size, max_turns
        self.max_observation_tokens, self.step_timeout_s, self.on_error = (
            max_observation_tokens,
            step_timeout_s,
            on_error,
        )
        self.caller = DaemonCaller(env_class.__name__, max_abandoned_calls)

    def render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools or None, add_generation_prompt=True, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def call(self, conversation: Conversation, method: str, *args):
        """env.<method>(*args) with producer.step_timeout_s; EnvError naming the row when it raises or times out."""
        try:
            return self.caller(getattr(conversation.env, method), args, self.step_timeout_s)
        except AbandonedCallsError:  # not the row's error: the run's
            raise
        except CallTimeout:
            raise EnvError(f"{method} took longer than producer.step_timeout_s = {self.step_timeout_s} s") from None
        except Exception as exc:  # noqa: BLE001 - whatever the user's environment raises is reported with its row
            raise EnvError(f"{method} raised {type(exc).__name__}: {exc}") from exc

    def failed(self, conversation: Conversation, exc: EnvError) -> None:
        """reward.on_error: fail stops the step naming the row; wrong ends the episode with reward 0."""
        if self.on_error == "fail":
            raise EnvError(
                f"environment {self.env_class.__name__} on row {conversation.row['prompt']!r}: {exc} "
                "(reward.on_error: fail)"
            ) from exc
        conversation.done, conversation.reward = True, 0.0
        conversation.info["env_errors"] += 1

    def start(self, problem: Problem) -> Conversation:
        row = reward_row(problem)
        kwargs = (problem.metadata or {}).get("env_kwargs", {})
        env = self.env_class(tools=self.tools, **kwargs)
        conversation = Conversation(env, row, [], "")
        try:
            conversation.messages = list(self.call(conversation, "reset", row))
        except EnvError as exc:
            self.failed(conversation, exc)
            conversation.segments.append(Segment(self.encode(self.tokenizer.bos_token), [], [], "stop", "turn", 0, []))
            return conversation
        conversation.text = self.render(conversation.messages)
        conversation.segments.append(Segment(self.encode(conversation.text), [], [], "stop", "turn", 0, []))
        return conversation

    def observe(self, c: Conversation, reply_ids: list[int], reason: str) -> None:
        """The reply goes to the environment; its observations extend the row or start a new segment."""
        reply = self.tokenizer.decode(reply_ids, skip_special_tokens=False)
        eos = self.tokenizer.eos_token
        content = reply[: -len(eos)] if reason == "stop" and reply.endswith(eos) else reply
        c.text += reply
        c.messages.append({"role": "assistant", "content": content})
        c.info["turns"] += 1
        calls, errors = parse_tool_calls(content)
        c.info["tool_calls"] += len(calls) + len(errors)
        c.info["tool_errors"] += len(errors)
        try:
            observation, reward, done = self.call(c, "step", content)
            observation = check_observation(observation)
        except EnvError as exc:
            self.failed(c, exc)
            return
        if done:
            c.done, c.reward = True, float(reward)
            return
        if c.info["turns"] >= self.max_turns:  # the policy's own outcome (it kept calling tools): scored as wrong
            c.done, c.reward = True, 0.0
            c.info["max_turns_reached"] = 1
            return
        if observation and observation[0].get("new_context"):  # the environment starts the context over
            c.messages = [{k: v for k, v in m.items() if k != "new_context"} for m in observation]
        else:
            c.messages += observation or []
        text = self.render(c.messages)
        segment = c.segments[-1]
        if text.startswith(c.text):  # the same row goes on: the observation's tokens are not trained
            observed = self.encode(text[len(c.text) :])
            if len(observed) > self.max_observation_tokens and observation:
                c.messages, text, observed = self.cut_observation(c.messages, len(observation), c.text, len(observed))
                c.info["observations_cut"] += 1
            segment.response_ids += observed
            segment.engine_logprobs += [0.0] * len(observed)
            segment.loss_mask += [0] * len(observed)
            c.info["observation_tokens"] += len(observed)
            c.text = text
        else:  # the context was reset: a new segment
            c.segments.append(Segment(self.encode(text), [], [], "stop", "turn", 0, []))
            c.text = text

    def cut_observation(
        self, messages: list[dict], new: int, row_text: str, observed: int
    ) -> tuple[list[dict], str, list[int]]:
        """(messages, rendering, the rendering's tokens past row_text) with the last `new` messages' contents cut,
        earlier ones first, until those tokens fit producer.max_observation_tokens. The template's framing (the tool
        output markers, the next assistant header) is never cut: contents get the budget it leaves, down to
        nothing. Cut messages stay in the conversation, so the next prompt still extends the row."""
        contents = [self.encode(m["content"]) for m in messages[-new:]]
        allowed = self.max_observation_tokens - (observed - sum(map(len, contents)))  # the budget less the framing
        while True:
            kept, left = list(messages[:-new]), max(allowed, 0)
            for m, ids in zip(messages[-new:], contents):
                kept.append({**m, "content": self.tokenizer.decode(ids[:left], skip_special_tokens=False)})
                left -= min(left, len(ids))
            text = self.render(kept)
            tokens = self.encode(text[len(row_text) :])
            if len(tokens) <= self.max_observation_tokens or allowed <= 0:  # a cut may re-tokenize a token longer
                return kept, text, tokens
            allowed -= len(tokens) - self.max_observation_tokens

    def run(self, problems: list[Problem], n: int, sampling: Sampling) -> list[Conversation]:
        """n episodes per problem, every active one advanced one reply per engine call."""
        conversations = [self.start(p) for p in problems for _ in range(n)]
        for _ in range(self.max_turns):
            active = [c for c in conversations if not c.done]
            if not self.engine.agreed_rounds(int(bool(active))):
                break
            rollout = self.engine.generate(
                [c.segments[-1].prompt_ids + c.segments[-1].response_ids for c in active], 1, sampling
            )
            for c, ids, logprobs, reason in zip(active, rollout.response_ids, rollout.logprobs, rollout.finish_reasons):
                segment = c.segments[-1]
                segment.response_ids = segment.response_ids + ids
                segment.engine_logprobs = segment.engine_logprobs + logprobs
                segment.loss_mask = segment.loss_mask + [1] * len(ids)
                segment.finish_reason, segment.adapter_version = reason, rollout.adapter_version
                self.observe(c, ids, reason)
        return conversations

    def generate(self, problems: list[Problem]) -> list[Episode]:
        conversations = self.run(problems, self.group_size, self.sampling)
        episodes = []
        for c in conversations:
            segments = [s for s in c.segments if s.response_ids] or c.segments[:1]
            episodes.append(Episode(segments, c.reward, c.reward > 0, {**c.info, "segments": len(segments)}))
        return episodes

    def evaluate(self, problems, problem_ids, samples, sampling, memory, score_answers) -> list:
        """The conversations run to the end; the environment's reward scores each (not score_answers)."""
        refuse_memory_ablation(memory)
        return agent_records(self.run(problems, samples, sampling), problem_ids, samples)

    def close(self) -> None:
        self.caller.close()


def agent_records(conversations: list[Conversation], problem_ids: list[int], n: int) -> list:
    """evals.report.SampleRecord per episode: its last reply, the environment's reward, its reply tokens (the
    trained ones, observations excluded) and its tool calls."""
    from evals.report import SampleRecord
    from evals.rewards import answer_of

    records = []
    for i, c in enumerate(conversations):
        replies = [m["content"] for m in c.messages if m["role"] == "assistant"]
        last = replies[-1] if replies else ""
        tokens = sum(sum(s.loss_mask) for s in c.segments)
        reason = c.segments[-1].finish_reason if c.segments else "stop"
        records.append(
            SampleRecord(
                problem_ids[i // n],
                c.row["prompt"],
                last,
                answer_of("arithmetic", last),
                c.reward,
                c.reward > 0,
                tokens,
                reason,
                c.info["tool_calls"],
            )
        )
    return records


@register_producer
@dataclass
class AgentSettings(ProducerDefaults):
    """producer.kind agent: multi-turn tool agents; an environment answers each reply until it says done."""

    kind: str = field(default="agent", init=False)
    logs_episode_info: ClassVar[bool] = True
    uses_tools: ClassVar[bool] = True
    env: str = ""  # "package.module:Class" with reset(row) and step(assistant_text) (allsync/envs/__init__.py)
    tools: list[dict] = field(
        default_factory=list
    )  # OpenAI function schemas: {type: function, function: {name, description, parameters}}
    max_turns: int = 4  # replies per episode; an episode not done by then is an ordinary wrong outcome
    max_observation_tokens: int = 256  # an observation's tokens beyond this are cut (and counted)
    step_timeout_s: float = 10.0  # an env.reset / env.step slower than this is an error (reward.on_error)
    # calls past step_timeout_s still running at once (each keeps its thread, maybe a core): one more stops the run
    max_abandoned_calls: int = 4

    def check(self, fail) -> None:
        from allsync.envs import load_env_class

        try:
            load_env_class(self.env)
        except ValueError as exc:
            fail(f"producer.env: {exc}")
        for i, tool in enumerate(self.tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if (
                tool.get("type") != "function"
                or not isinstance(function, dict)
                or not isinstance(function.get("name"), str)
                or not isinstance(function.get("description", ""), str)
                or not isinstance(function.get("parameters", {}), dict)
            ):
                fail(
                    f"producer.tools[{i}]: expected an OpenAI function schema {{type: function, function: {{name, description, "
                    f"parameters}}}}, got {tool!r}"
                )
        if self.max_abandoned_calls < 0:
            fail(f"producer.max_abandoned_calls = {self.max_abandoned_calls}: must be >= 0")
        if self.max_turns < 1 or self.max_observation_tokens < 1 or not self.step_timeout_s > 0:
            fail(
                f"producer.max_turns ({self.max_turns}) and producer.max_observation_tokens ({self.max_observation_tokens}) "
                f"must be >= 1 and producer.step_timeout_s ({self.step_timeout_s}) > 0"
            )

    def check_with(self, config, fail) -> None:
        a, rw = config.algorithm, config.reward
        if not a.estimator.needs_groups:
            fail(
                f"producer.kind agent with algorithm.advantage {a.advantage}: an episode's one reward trains its turns "
                f"through a group-relative advantage; use {estimators_that(needs_groups=True)}"
            )
        if (
            rw.function is not None
            or rw.name != config.task.default_reward
            or rw.length is not None
            or a.overlong is not None
            or rw.timeout_s != type(rw).timeout_s
        ):
            fail(
                "reward.name / reward.function / reward.timeout_s / reward.length / algorithm.overlong with producer.kind "
                "agent: the environment's step returns the episode's reward; leave them out (reward.on_error still "
                "applies, and producer.step_timeout_s bounds each environment call)"
            )

    def build(self, context: ProducerContext) -> GroupRounds:
        from allsync.envs import load_env_class

        c = context.config
        agent = ToolAgent(
            context.engine,
            context.tokenizer,
            load_env_class(self.env),
            self.tools,
            Sampling.for_training(c.rollout),
            c.rollout.group_size,
            self.max_turns,
            self.max_observation_tokens,
            self.step_timeout_s,
            c.reward.on_error,
            self.max_abandoned_calls,
        )
        return GroupRounds(agent, context)

    def model_len(self, config, tokenizer, problems: list[Problem], max_position_embeddings: int) -> int:
        """Its last turn's prompt (the problem with producer.tools, then max_turns - 1 replies and observations) +
        rollout.max_new_tokens."""
        new_tokens = config.rollout.max_new_tokens
        longest = longest_last_turn_prompt(
            tokenizer, problems, self.tools, self.max_turns, new_tokens, self.max_observation_tokens
        )
        return model_len_needed(
            longest,
            new_tokens,
            max_position_embeddings,
            prompt_name=(
                f"the longest last-turn prompt (the problem with producer.tools, then producer.max_turns - 1 = {self.max_turns - 1} "
                f"replies of rollout.max_new_tokens and observations of producer.max_observation_tokens = {self.max_observation_tokens})"
            ),
        )
