"""Step metrics: aggregation over workers, JSONL + TensorBoard logging, and the PNG plot of a run."""

from __future__ import annotations

import json
from pathlib import Path

from quant.checkpoint_io import atomic_write_text


def aggregate(per_worker: list[dict]) -> dict:
    """Worker sums -> run metrics (means over samples/tokens; utilization = busy / wall per worker)."""
    total = lambda key: sum(m[key] for m in per_worker)  # noqa: E731
    samples = total("samples_generated")
    tokens = max(total("trained_tokens"), 1)
    wall = max(m["wall_seconds"] for m in per_worker)
    per_sample = {  # means over the samples finished this step; absent when none finished (T-PPO windows)
        "reward": total("reward_sum") / samples,
        "accuracy": total("correct_sum") / samples,
        "response_length": total("response_tokens") / samples,
        "truncated_fraction": total("truncated") / samples,
    } if samples else {}  # fmt: skip
    return {
        **per_sample,
        "groups_kept": total("groups_kept"),
        "groups_generated": total("groups_generated"),
        "sampling_rounds": max(m["sampling_rounds"] for m in per_worker),
        "trained_samples": total("trained_samples"),
        "loss": total("loss_sum"),
        "clipfrac_high": total("clipfrac_high_sum") / tokens,
        "clipfrac_low": total("clipfrac_low_sum") / tokens,
        "approx_kl": total("kl_sum") / tokens,
        "logprob_gap": max(m["logprob_gap"] for m in per_worker),
        "grad_norm": per_worker[0]["grad_norm"],
        "nan_steps": per_worker[0]["nan_steps"],
        "sync_bytes": total("sync_bytes"),
        "staleness_max": max(m["staleness_max"] for m in per_worker),  # T-PPO: context of continuing responses
        "continuing": total("continuing"),  # T-PPO: responses cut at the window, continued next step
        "step_seconds": wall,
        "samples_per_second": total("samples_generated") / wall,
        "utilization": sum(m["busy_seconds"] for m in per_worker) / (wall * len(per_worker)),
    }


class MetricsLog:
    """Appends one JSON object per step to metrics.jsonl and mirrors scalars to TensorBoard."""

    def __init__(self, out_dir: str | Path, resume_step: int | None = None):
        """resume_step: keep the records up to that step (a killed run may have logged steps after its
        last checkpoint; they are redone); None starts a fresh log."""
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        if self.path.exists():
            kept = [r for r in self.records() if resume_step is not None and r["step"] <= resume_step]
            atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
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
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def close(self) -> None:
        self.tb.close()


def plot_run(records: list[dict], path: str | Path) -> Path:
    """Reward, held-out accuracy, response length and utilization per step, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [("reward", "train reward"), ("heldout_accuracy", "held-out accuracy"),
              ("response_length", "response length (tokens)"), ("utilization", "worker utilization")]  # fmt: skip
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
