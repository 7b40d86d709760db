"""Step metrics: aggregation over workers, JSONL + TensorBoard logging, and the PNG plot of a run."""

from __future__ import annotations

import json
from pathlib import Path

from quant.checkpoint_io import atomic_write_text

LOSS_STAT_PREFIX = "loss_stat_"


def loss_stat_key(name: str) -> str:
    """A worker's token sum of the policy loss's statistic `name` (PolicyLossEntry.logged); the run metric `name`
    is the sum over workers over the trained tokens."""
    return LOSS_STAT_PREFIX + name


def aggregate(per_worker: list[dict]) -> dict:
    """Worker sums -> run metrics. Means over samples finished this step (reward, accuracy, length) or over
    trained tokens (the policy loss's statistics, e.g. clip fractions and approx_kl; entropy, kl_ref). utilization = busy / wall per worker, where
    busy excludes the time a worker waits in the learner's all-reduces for the others (allsync.health.monitor.Timeline;
    the MoE all-to-alls of expert parallelism are inside forward and backward and count as busy)."""
    total = lambda key: sum(m[key] for m in per_worker)  # noqa: E731
    samples = total("samples_generated")
    tokens = max(total("trained_tokens"), 1)
    wall = max(m["wall_seconds"] for m in per_worker)
    per_sample = (
        {  # means over the samples finished this step; absent when none finished (T-PPO windows)
            "reward": total("reward_sum") / samples,
            "accuracy": total("correct_sum") / samples,
            "response_length": total("response_tokens") / samples,
            "correct_per_1k_tokens": 1000
            * total("correct_sum")
            / max(total("response_tokens"), 1),  # balanced reasoning
            "truncated_fraction": total("truncated") / samples,
        }
        if samples
        else {}
    )
    per_token = (
        {  # absent when no token was trained this step
            **{  # the policy loss's own statistics (the clipped loss: clipfrac_high, clipfrac_low, approx_kl)
                key[len(LOSS_STAT_PREFIX) :]: sum(m.get(key, 0.0) for m in per_worker) / tokens
                for key in sorted({k for m in per_worker for k in m if k.startswith(LOSS_STAT_PREFIX)})
            },
            "entropy": total("entropy_sum") / tokens,
            "kl_ref": total("kl_ref_sum") / tokens,
            # algorithm.tis: the mean importance weight and the share of tokens the cap cut
            **(
                {
                    "tis_mean": sum(m.get("tis_sum", 0.0) for m in per_worker) / tokens,
                    "tis_clipfrac": sum(m.get("tis_capped_sum", 0.0) for m in per_worker) / tokens,
                }
                if any("tis_sum" in m for m in per_worker)
                else {}
            ),
            # the engine's positions computed (the torch engine: prefills' padded rows, decode steps' live rows; vLLM:
            # prompt and generated tokens) per trained token; T-PPO's windows re-prefill the prompt and the reply so
            # far once a step
            **(
                {"positions_per_trained_token": sum(m.get("engine_positions", 0) for m in per_worker) / tokens}
                if any("engine_positions" in m for m in per_worker)
                else {}
            ),
            # the torch engine's recorded experts against the trainer's own choice, per (trained token, MoE layer)
            **(
                {"routing_mismatch": sum(m.get("routing_mismatched", 0) for m in per_worker) / counted}
                if (counted := sum(m.get("routing_counted", 0) for m in per_worker))
                else {}
            ),
        }
        if total("trained_tokens")
        else {}
    )
    return {
        **per_sample,
        **per_token,
        "groups_wanted": total("groups_wanted"),
        "groups_kept": total("groups_kept"),
        "groups_generated": total("groups_generated"),
        "sampling_rounds": max(m["sampling_rounds"] for m in per_worker),
        "sampling_cap_hits": total("sampling_cap_hits"),  # workers that reached max_sampling_rounds this step
        # algorithm.sampling_rounds streamed: rows of rounds begun but not needed (decoded work the batch does not use)
        **({"samples_dropped": total("samples_dropped")} if any("samples_dropped" in m for m in per_worker) else {}),
        "reward_errors": total("reward_errors"),  # samples whose reward raised or timed out (reward.on_error: wrong)
        "trained_samples": total("trained_samples"),
        "trained_tokens": total("trained_tokens"),
        "loss": total("loss_sum"),
        "logprob_gap": max(m["logprob_gap"] for m in per_worker),
        "logprob_gap_max": max(m["logprob_gap_max"] for m in per_worker),  # the largest over every token
        "grad_norm": per_worker[0]["grad_norm"],  # the policy's LoRA tensors
        **(
            {"value_grad_norm": per_worker[0]["value_grad_norm"]} if "value_grad_norm" in per_worker[0] else {}
        ),  # T-PPO's critic
        # the critic's values before the update against its targets: 1 - Var(R - V) / Var(R) (0: the mean return)
        **value_fit_metric(per_worker),
        # the critic's 0.5 (V - R)^2 over the finished responses' tokens (each worker sums its share)
        **(
            {"value_loss": sum(m.get("value_loss_sum", 0.0) for m in per_worker)}
            if any("value_loss_sum" in m for m in per_worker)
            else {}
        ),
        "optimizer_steps": per_worker[0]["optimizer_steps"],
        "empty_minibatches": per_worker[0]["empty_minibatches"],  # no token on any worker: no optimizer step
        "nan_steps": per_worker[0]["nan_steps"],  # non-finite loss or gradient norm: step skipped on every worker
        "sync_bytes": total("sync_bytes"),
        # an engine with its own adapter copy (vLLM): the largest gap of the adapter's effect on the sync probe, and
        # each worker's synced version's SHA-256 (first 16 hex digits), as both sides computed it
        **(
            {
                "sync_probe_gap": max(m["sync_probe_gap"] for m in per_worker),
                "sync_sha256": [m["sync_sha256"] for m in per_worker],
            }
            if "sync_probe_gap" in per_worker[0]
            else {}
        ),
        "staleness_max": max(m["staleness_max"] for m in per_worker),  # T-PPO: context of continuing responses
        "continuing": total("continuing"),  # T-PPO: responses cut at the window, continued next step
        "step_seconds": wall,
        "samples_per_second": total("samples_generated") / wall,
        "utilization": sum(m["busy_seconds"] for m in per_worker) / (wall * len(per_worker)),
        # the torch engine: the tokens of its decode forwards / (KV slots x decode forwards), the pool's occupancy
        # (below 1 while no queued row is left to take a freed slot: allsync/engines/slots.py)
        **(
            {"decode_fill": total("decoded_tokens") / slots}
            if (slots := sum(m.get("decode_slots", 0) for m in per_worker))
            else {}
        ),
        # expert parallelism only: bytes sent to other ranks by the MoE all-to-alls (tokens, outputs, gradients), and
        # the part sent to other nodes (an EP group over several nodes: moe_lora.expert_parallel's rail exchange)
        **(
            {key: total(key) for key in ("alltoall_bytes", "alltoall_bytes_across_nodes")}
            if "alltoall_bytes" in per_worker[0]
            else {}
        ),
        **ratio_metrics(per_worker),
    }


def value_fit_metric(per_worker: list[dict]) -> dict:
    """value_explained_variance over every worker's finished responses (allsync.algorithms.explained_variance),
    absent without a critic or when no response finished; advantage_cut_mean / advantage_finished_mean, the raw
    (before whitening) mean advantage of the trained tokens of responses cut at a window / finished
    (allsync.algorithms.split_advantage_sums), each absent when there were none."""
    from allsync.algorithms import explained_variance

    parts = [m["value_fit_sums"] for m in per_worker if "value_fit_sums" in m]
    ev = explained_variance([sum(column) for column in zip(*parts)]) if parts else None
    out = {} if ev is None else {"value_explained_variance": ev}
    splits = [m["advantage_split_sums"] for m in per_worker if "advantage_split_sums" in m]
    if splits:
        cut, n_cut, finished, n_finished = (sum(column) for column in zip(*splits))
        out.update({"advantage_cut_mean": cut / n_cut} if n_cut else {})
        out.update({"advantage_finished_mean": finished / n_finished} if n_finished else {})
    return out


def ratio_metrics(per_worker: list[dict]) -> dict:
    """Multi-segment episodes: `episode_<x>_sum / episode_<x>_count` over every worker as `<x>_per_episode`
    (segments, memory tokens, truncated / malformed memory writes, memory exact-match), and the logprob gap
    per segment kind `logprob_gap_<kind>_sum / _tokens` as `logprob_gap_<kind>`."""
    keys = {k for m in per_worker for k in m}
    total = lambda key: sum(m.get(key, 0.0) for m in per_worker)  # noqa: E731
    out = {}
    for key in sorted(k for k in keys if k.startswith("episode_") and k.endswith("_sum")):
        name = key[len("episode_") : -len("_sum")]
        if total(f"episode_{name}_count"):
            out[f"{name}_per_episode"] = total(key) / total(f"episode_{name}_count")
    for key in sorted(k for k in keys if k.startswith("logprob_gap_") and k.endswith("_sum")):
        kind = key[len("logprob_gap_") : -len("_sum")]
        if total(f"logprob_gap_{kind}_tokens"):
            out[f"logprob_gap_{kind}"] = total(key) / total(f"logprob_gap_{kind}_tokens")
    return out


def read_records(path: Path) -> list[dict]:
    """The JSON lines of metrics.jsonl. A last line cut short (a run killed while writing it) is dropped with
    a warning: the resumed run redoes that step. A bad line before the last is an error naming file:line."""
    lines = Path(path).read_text().split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if any(rest.strip() for rest in lines[number:]):
                raise ValueError(f"{path}:{number}: not a JSON line ({exc})") from exc
            print(f"warning: {path}:{number}: dropped a torn last line ({line[:60]!r}...)")
    return records


def restart_log(path: Path, resume_step: int | None) -> list[dict]:
    """Keep a JSONL log's records up to `resume_step` (a killed run may have logged steps after its last
    checkpoint; they are redone), or none for a fresh run (None); returns the records kept."""
    if not path.exists():
        return []
    kept = [r for r in read_records(path) if r["step"] <= resume_step] if resume_step is not None else []
    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept


class MetricsLog:
    """Appends one JSON object per step to metrics.jsonl and mirrors scalars to TensorBoard."""

    def __init__(self, out_dir: str | Path, resume_step: int | None = None):
        """resume_step: keep the records up to that step (a killed run may have logged steps after its
        last checkpoint; they are redone); None starts a fresh log."""
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        restart_log(self.path, resume_step)
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(str(self.out_dir / "tensorboard"))

    def write(self, step: int, metrics: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                self.tb.add_scalar(key, value, step)
        self.tb.flush()

    def records(self) -> list[dict]:
        return read_records(self.path)

    def close(self) -> None:
        self.tb.close()


def plot_run(records: list[dict], path: str | Path) -> Path:
    """Reward, held-out accuracy, entropy, response length, samples/s and utilization per step, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    panels = [
        ("reward", "train reward"),
        ("heldout_accuracy", "held-out accuracy"),
        ("entropy", "policy entropy (nats/token)"),
        ("response_length", "response length (tokens)"),
        ("samples_per_second", "samples generated / s"),
        ("utilization", "utilization (busy outside collectives / wall)"),
    ]
    for ax, (key, title) in zip(axes.flat, panels):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points), marker="o" if key == "heldout_accuracy" else None)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
