"""Episodes: the unit between generation and the update.

An episode is a list of segments with one reward. A segment is one conversation the model answered:
its prompt ids, its response ids, a per-token loss mask (0 on tokens the model did not choose, such as
tool observations), the engine's logprobs, its finish reason, its kind and the adapter version that
produced it. A single-turn sample is the one-segment episode; multi-conversation memory writes, tool-agent
turns and T-PPO windows are other producers' episodes (allsync/producers/). The update (allsync/update/learner.py)
sees only the rows of `flatten(episodes)`: one row per segment, its episode's id, whether it is the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SEGMENT_KINDS = ("answer", "memory", "turn")


@dataclass
class Segment:
    prompt_ids: list[int]
    response_ids: list[int]
    engine_logprobs: list[float]
    finish_reason: str  # "stop" (eos), "length", or "window" (T-PPO: cut at a window, generation goes on)
    kind: str = "answer"  # answer | memory | turn
    adapter_version: int = 0  # the adapter that generated its trained tokens
    loss_mask: list[int] | None = None  # per response token, 0 = not trained; None = every token trained
    routing: object = None  # torch engine: [prompt + response - 1, MoE layers, k] experts each fed token went to


@dataclass
class Episode:
    segments: list[Segment]
    reward: float
    correct: bool
    info: dict = field(default_factory=dict)  # per-episode counts the metrics sum (memory tokens, tool calls ...)

    @staticmethod
    def single(
        prompt_ids: list[int],
        response_ids: list[int],
        engine_logprobs: list[float],
        finish_reason: str,
        reward: float,
        correct: bool,
        adapter_version: int,
        routing=None,
    ) -> "Episode":
        """Today's single-turn sample: one answer segment."""
        return Episode(
            [
                Segment(
                    prompt_ids, response_ids, engine_logprobs, finish_reason, "answer", adapter_version, None, routing
                )
            ],
            reward,
            correct,
        )

    @property
    def final(self) -> Segment:
        return self.segments[-1]

    @property
    def response_tokens(self) -> int:
        return sum(len(s.response_ids) for s in self.segments)


@dataclass
class Rows:
    """Every segment of a list of episodes as one row each, in episode order."""

    segments: list[Segment]
    episode_of_row: list[int]  # index of the row's episode in the list
    is_answer: list[bool]
    truncated_episode: list[bool]  # the row's episode's answer ended at the token budget ("length")

    @property
    def prompt_ids(self) -> list[list[int]]:
        return [s.prompt_ids for s in self.segments]

    @property
    def response_ids(self) -> list[list[int]]:
        return [s.response_ids for s in self.segments]

    @property
    def engine_logprobs(self) -> list[list[float]]:
        return [s.engine_logprobs for s in self.segments]

    @property
    def routing(self) -> list | None:
        """Every row's recorded experts, or None unless every row has them."""
        found = [s.routing for s in self.segments]
        return None if any(r is None for r in found) else found

    @property
    def loss_masks(self) -> list[list[int]] | None:
        """Per-token loss masks of every row (all ones where a segment has none), or None when no segment has one."""
        if all(s.loss_mask is None for s in self.segments):
            return None
        return [s.loss_mask if s.loss_mask is not None else [1] * len(s.response_ids) for s in self.segments]


def flatten(episodes: list[Episode]) -> Rows:
    segments, episode_of_row, is_answer, truncated = [], [], [], []
    for e, episode in enumerate(episodes):
        for s in episode.segments:
            segments.append(s)
            episode_of_row.append(e)
            is_answer.append(s.kind == "answer")
            truncated.append(episode.final.finish_reason == "length")
    return Rows(segments, episode_of_row, is_answer, truncated)


def stale_versions(episodes: list[Episode], version: int) -> list[int]:
    """Adapter versions other than `version` among the episodes' segments that hold tokens (all-sync trains
    only its own)."""
    return [s.adapter_version for e in episodes for s in e.segments if s.response_ids and s.adapter_version != version]


def episode_info_sums(episodes: list[Episode]) -> dict[str, float]:
    """Each info key summed over the episodes, as `episode_<key>_sum`, plus `episode_<key>_count` (how many
    episodes report it): the controller divides the two for the mean per episode."""
    sums: dict[str, float] = {}
    for e in episodes:
        for key, value in e.info.items():
            sums[f"episode_{key}_sum"] = sums.get(f"episode_{key}_sum", 0.0) + float(value)
            sums[f"episode_{key}_count"] = sums.get(f"episode_{key}_count", 0.0) + 1.0
    return sums
