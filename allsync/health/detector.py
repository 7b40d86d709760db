"""Finding the faulty worker from per-worker step reports, in the spirit of Minder (arXiv 2411.01791).

All-sync workers do the same work every step (each generates and trains its share of the batch), so a healthy
worker looks like the others and a faulty one stands out. Per step, for each metric in priority order:

1. normalize: u_w = f(x_w) - median_v f(x_v), f = log for positive rates and sizes (a step that is slow for
   everyone moves every worker alike), then divided by the metric's noise scale
       sigma = the `quantile` of |u| over every worker and the last `history` steps   (floored at `floor` x level,
       and for linear metrics at their `min_scale`),
   a high quantile because step noise has heavy tails (on 2 shared cores p90 |u| is 3-6x the median |u|);
2. window: each worker's mean of u / sigma over the last `window` steps;
3. similarity: a worker's distance to the others, d_w = mean_{v != w} |ubar_w - ubar_v|, and its z-score
   across workers, z_w = (d_w - mean d) / std d; a worker is flagged when d_w >= min_distance (noise units),
   z_w >= min_z and it deviates in the metric's bad direction (a slow worker has fewer tokens/s, not more);
4. priority: the first metric (most telling first) that flags any worker names it; later metrics are not read;
5. continuity: an alarm when the same worker is flagged `continuity` steps in a row. Two things alarm at once,
   being never noise: a non-finite value where the others are finite, and a distance of `instant` x
   min_distance or more (a stall of many times the step). One alarm per episode of flags.

Telling which of two workers is faulty is impossible by similarity: it needs three or more. `ThresholdDetector`
is the baseline it is compared against (benchmarks/faults.py): a worker's raw value beyond the running mean
+- k standard deviations of every worker's values, alarm at once.

Both detectors take one step at a time (`observe(step, reports)`, reports in rank order, None for a worker that
sent none) and return the step's `Alarm`s; `replay` runs one over a recorded workers.jsonl.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Signal:
    """One per-worker metric: its key in the worker's report, the bad direction (high, low or both) and
    whether it is compared in log space (positive rates and sizes)."""

    key: str
    bad: str
    log: bool
    min_level: float = 0.0  # below this median (raw units) the metric is timer noise and says nothing
    min_scale: float = 0.0  # noise scale >= this (raw units, linear metrics): a level of 0 gives no floor of its own


# most telling first: a non-finite or outlying local gradient, then the phases' throughput, then resources
PRIORITY = (
    Signal("local_grad_norm", "both", True),
    Signal("generate_tokens_per_second", "low", True),
    Signal("train_tokens_per_second", "low", True),
    Signal("routed_rows_per_second", "low", True),  # expert parallelism: the rows a rank's experts received / busy s
    Signal("sync_seconds", "high", True, min_level=0.05),  # the torch engine's sync is a no-op: microseconds
    # most steps grow no worker's memory at all, so the noise scale would collapse to 0 and a page of heap after a
    # checkpoint read as a leak (precision 0.659 in the drill with checkpoints on); 16 MiB keeps a 128 MiB leak at 8
    Signal("rss_growth_bytes", "high", False, min_scale=16 * 2**20),
    Signal("cpu_percent", "both", True),
    Signal("gpu_utilization", "low", False),
    Signal("gpu_power_watts", "both", False),
    Signal("gpu_temperature_c", "high", False),
)


@dataclass(frozen=True)
class Alarm:
    step: int
    rank: int
    metric: str
    distance: float  # noise units (similarity) or standard deviations (threshold)
    detector: str
    direction: str = ""  # high | low | non-finite

    def describe(self) -> str:
        unit = "x noise" if self.detector == "similarity" else "sd"
        what = (
            f"non-finite {self.metric}"
            if self.direction == "non-finite"
            else f"{self.direction} {self.metric}, {self.distance:.1f} {unit}"
        )
        return f"step {self.step}: worker {self.rank} is faulty ({what}, {self.detector})"


def signal_values(reports: list[dict | None], signal: Signal) -> tuple[np.ndarray, np.ndarray] | None:
    """(values, broken) for every worker: the metric (log of it for log signals; NaN where a worker did not
    report it, or where a log signal is 0, e.g. no token trained), and whether it reported a NaN or inf.
    None when no worker reports the metric."""
    values = [r.get(signal.key) if r is not None else None for r in reports]
    if all(v is None for v in values):
        return None
    raw = np.array([np.nan if v is None else float(v) for v in values], dtype=np.float64)
    broken = np.array([v is not None and not math.isfinite(v) for v in values])
    if signal.log:
        with np.errstate(divide="ignore", invalid="ignore"):
            raw = np.where(raw > 0, np.log(np.where(raw > 0, raw, 1.0)), np.nan)
    return np.where(broken, np.nan, raw), broken


def non_finite_outliers(broken: np.ndarray) -> list[int]:
    """Workers that reported a NaN or inf while most did not."""
    return np.flatnonzero(broken).tolist() if 0 < broken.sum() < broken.size / 2 else []


def similarity_flags(
    window: np.ndarray, bad: str, min_distance: float, min_z: float
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """window: [steps, workers] normalized deviations. Returns (flagged workers, distances d, sides):
    ubar_w = mean over steps, d_w = mean_{v != w} |ubar_w - ubar_v|, z_w = (d_w - mean d) / std d,
    side_w = ubar_w - median ubar (> 0: above the others)."""
    ubar = window.mean(axis=0)
    n = ubar.size
    d = np.abs(ubar[:, None] - ubar[None, :]).sum(axis=1) / max(n - 1, 1)
    spread = d.std()
    z = (d - d.mean()) / spread if spread > 0 else np.zeros(n)
    side = ubar - np.median(ubar)
    direction_ok = {"high": side > 0, "low": side < 0, "both": np.ones(n, dtype=bool)}[bad]
    flagged = np.flatnonzero((d >= min_distance) & (z >= min_z) & direction_ok)
    return flagged.tolist(), d, side


@dataclass
class SimilarityDetector:
    window: int = 2
    continuity: int = 2
    min_distance: float = 2.0
    min_z: float = 1.5
    instant: float = 4.0
    history: int = 50
    warmup: int = 5  # steps of noise history before similarity alarms (non-finite values alarm from the start)
    floor: float = 0.01  # noise scale >= floor (1% in log space)
    quantile: float = 0.9
    name: str = "similarity"
    _deviations: dict = field(default_factory=dict)  # metric -> deque of per-step |u| vectors (the noise history)
    _windows: dict = field(default_factory=dict)  # metric -> deque of per-step u vectors
    _streak: dict = field(default_factory=dict)  # rank -> consecutive flagged steps
    _raised: set = field(default_factory=set)  # ranks alarmed in their current streak

    def observe(self, step: int, reports: list[dict | None]) -> list[Alarm]:
        reported = np.array([r is not None for r in reports])
        flagged: dict[int, tuple[Signal, float, str]] = {}
        instant: list[Alarm] = []
        for signal in PRIORITY:
            values = signal_values(reports, signal)
            if values is None:
                continue
            x, broken = values
            if (bad := non_finite_outliers(broken)) and not flagged:
                instant = [Alarm(step, r, signal.key, math.inf, self.name, "non-finite") for r in bad]
                flagged = {r: (signal, math.inf, "non-finite") for r in bad}
            u = self._normalized(signal, x)
            if u is None or flagged:
                continue
            win = np.stack(self._windows[signal.key])
            if len(self._deviations[signal.key]) < self.warmup or reported.sum() < 3:
                continue
            hits, d, side = similarity_flags(win, signal.bad, self.min_distance, self.min_z)
            if hits:
                flagged = {r: (signal, float(d[r]), "high" if side[r] > 0 else "low") for r in hits}
        at_once = {r for r, (_, distance, _) in flagged.items() if distance >= self.instant * self.min_distance}
        return instant + self._continuity(step, flagged, {a.rank for a in instant}, at_once)

    def _normalized(self, signal: Signal, x: np.ndarray) -> np.ndarray | None:
        """Deviation from the workers' median in noise units; the step's values join the noise history."""
        finite = np.isfinite(x)
        if finite.sum() < 2:
            return None
        level = np.median(x[finite])
        if (math.exp(level) if signal.log else level) < signal.min_level:
            return None
        u = np.where(finite, x - level, 0.0)
        history = self._deviations.setdefault(signal.key, deque(maxlen=self.history))
        floor = self.floor if signal.log else max(self.floor * abs(level), signal.min_scale)
        past = (
            float(np.quantile(np.concatenate(history), self.quantile)) if history else 0.0
        )  # a fault cannot widen its own noise
        sigma = max(past, floor, 1e-12)
        history.append(np.abs(u[finite]))
        windows = self._windows.setdefault(signal.key, deque(maxlen=self.window))
        if windows and windows[0].shape != u.shape:
            windows.clear()
        windows.append(u / sigma)
        return u

    def _continuity(self, step: int, flagged: dict, already: set[int], at_once: set[int]) -> list[Alarm]:
        alarms = []
        for rank in list(self._streak):
            if rank not in flagged:
                self._streak.pop(rank)
                self._raised.discard(rank)
        for rank, (signal, distance, direction) in flagged.items():
            self._streak[rank] = self._streak.get(rank, 0) + 1
            if rank in already:
                self._raised.add(rank)
            elif (self._streak[rank] >= self.continuity or rank in at_once) and rank not in self._raised:
                self._raised.add(rank)
                alarms.append(Alarm(step, rank, signal.key, distance, self.name, direction))
        return alarms


@dataclass
class ThresholdDetector:
    """The baseline: per metric, the running mean and standard deviation of every worker's raw values over the
    last `history` steps; a worker beyond mean +- k sd in the bad direction alarms at once."""

    k: float = 4.0
    history: int = 50
    warmup: int = 5
    name: str = "threshold"
    _values: dict = field(default_factory=dict)

    def observe(self, step: int, reports: list[dict | None]) -> list[Alarm]:
        alarms, seen = [], set()
        for signal in PRIORITY:
            values = signal_values(reports, signal)
            if values is None:
                continue
            x, broken = values
            past = self._values.setdefault(signal.key, deque(maxlen=self.history))
            if len(past) >= self.warmup:
                pool = np.concatenate(list(past))
                pool = pool[np.isfinite(pool)]
                if pool.size == 0:
                    past.append(x)
                    continue
                mean, sd = pool.mean(), max(pool.std(), 1e-12)
                score = (x - mean) / sd
                hit = {"high": score > self.k, "low": score < -self.k, "both": np.abs(score) > self.k}[signal.bad]
                hit = (hit & np.isfinite(score)) | broken
                for r in np.flatnonzero(hit).tolist():
                    if r not in seen:
                        seen.add(r)
                        finite = math.isfinite(score[r])
                        alarms.append(
                            Alarm(
                                step,
                                r,
                                signal.key,
                                abs(float(score[r])) if finite else math.inf,
                                self.name,
                                ("high" if score[r] > 0 else "low") if finite else "non-finite",
                            )
                        )
            past.append(x)
        return alarms


DETECTORS = {"similarity": SimilarityDetector, "threshold": ThresholdDetector}


def make_detector(health) -> SimilarityDetector | ThresholdDetector | None:
    """The detector a config's `health` section names (None for off)."""
    if health.detector == "off":
        return None
    if health.detector == "threshold":
        return ThresholdDetector()
    return SimilarityDetector(
        window=health.window, continuity=health.continuity, min_distance=health.min_distance, min_z=health.min_z
    )


# ------------------------------------------------------------------------------------------ files
WORKERS_FILE = "workers.jsonl"
HEALTH_FILE = "health.jsonl"


def read_worker_records(run_dir: str | Path) -> list[dict]:
    """workers.jsonl: {"step", "time", "workers": [report or null per rank]} per step (torn last line dropped)."""
    from allsync.metrics import read_records

    path = Path(run_dir) / WORKERS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no per-worker records (written by recipes/dapo.py from this allsync on)")
    return read_records(path)


def replay(records: list[dict], detector) -> list[Alarm]:
    """Every alarm `detector` raises over recorded steps, in order."""
    return [a for r in records for a in detector.observe(r["step"], r["workers"])]


def alarm_record(alarm: Alarm) -> dict:
    out = asdict(alarm)
    out["distance"] = out["distance"] if math.isfinite(out["distance"]) else None
    return {"event": "alarm", **out}


def append_health(run_dir: str | Path, record: dict) -> None:
    """One JSON line in health.jsonl (alarms, restarts with their cause)."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    with (Path(run_dir) / HEALTH_FILE).open("a") as f:
        f.write(json.dumps(record) + "\n")


class HealthMonitor:
    """The controller's side, once per step: every worker's report to workers.jsonl (its health signals also to
    TensorBoard as workers/<metric>/rank<r>), the detector over the reports, and its alarms to health.jsonl. On resume the detector replays the records kept, so it starts where it was."""

    def __init__(self, run_dir: str | Path, detector, resume_step: int | None, tb=None):
        from allsync.metrics import restart_log

        self.run_dir, self.detector, self.tb = Path(run_dir), detector, tb
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / WORKERS_FILE
        kept = restart_log(self.path, resume_step)
        if detector is not None:
            replay(kept, detector)

    def observe(self, step: int, reports: list[dict | None]) -> list[Alarm]:
        started = time.perf_counter()
        workers = [None if r is None else {k: v for k, v in r.items() if isinstance(v, (int, float))} for r in reports]
        alarms = self.detector.observe(step, workers) if self.detector is not None else []
        for alarm in alarms:
            append_health(self.run_dir, alarm_record(alarm))
        if self.tb is not None:
            for rank, report in enumerate(workers):
                for signal in PRIORITY:
                    if report is not None and signal.key in report:
                        self.tb.add_scalar(f"workers/{signal.key}/rank{rank}", report[signal.key], step)
        row = {"step": step, "time": time.time(), "monitor_seconds": time.perf_counter() - started, "workers": workers}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        return alarms


# ------------------------------------------------------------------------------------------ report
PLOTTED = (
    ("generate_tokens_per_second", "gen tok/s", "generate: token positions / busy s"),
    ("train_tokens_per_second", "train tok/s", "train: token positions / busy s"),
    ("wait_seconds", "wait s", "waiting in collectives (s)"),
    ("local_grad_norm", "grad norm", "local gradient norm"),
    ("rss_bytes", "RSS MiB", "resident memory (MiB)"),
    ("cpu_percent", "CPU %", "process CPU (%)"),
)


def read_health_events(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / HEALTH_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def alarm_from_record(record: dict) -> Alarm:
    distance = record["distance"] if record["distance"] is not None else math.inf
    return Alarm(
        record["step"], record["rank"], record["metric"], distance, record["detector"], record.get("direction", "")
    )


def health_report(run_dir: str | Path, detector=None) -> tuple[str, list[Alarm]]:
    """A text report of a run's workers: per-worker medians of the main signals, the alarms (those the run
    raised, from health.jsonl, or `detector`'s over a replay of workers.jsonl) and the restarts with their cause."""
    records = [r for r in read_worker_records(run_dir) if r["step"] >= 1]
    if not records:
        raise ValueError(f"{Path(run_dir) / WORKERS_FILE}: no step recorded yet")
    events = read_health_events(run_dir)
    alarms = (
        replay(records, detector)
        if detector is not None
        else [alarm_from_record(e) for e in events if e["event"] == "alarm"]
    )
    n = max(len(r["workers"]) for r in records)
    seconds = np.diff([r["time"] for r in records])
    lines = [
        f"{run_dir}: steps {records[0]['step']}-{records[-1]['step']}, {n} workers"
        + (f", {np.median(seconds):.2f} s/step (median)" if seconds.size else "")
    ]
    keys = [k for k, _, _ in PLOTTED]
    lines.append("worker  " + "  ".join(f"{short:>11}" for _, short, _ in PLOTTED) + "  alarms")
    for rank in range(n):
        values = []
        for key in keys:
            xs = [
                r["workers"][rank][key]
                for r in records
                if rank < len(r["workers"]) and r["workers"][rank] and key in r["workers"][rank]
            ]
            scale = 2**20 if key == "rss_bytes" else 1
            values.append(f"{np.nanmedian(xs) / scale:>11.4g}" if xs else f"{'-':>11}")
        lines.append(f"{rank:>6}  " + "  ".join(values) + f"  {sum(a.rank == rank for a in alarms):>6}")
    lines[-n - 1] += "   (medians over steps)"
    lines.append(f"alarms: {len(alarms)}" + ("" if detector is None else f" ({detector.name}, replayed)"))
    lines += [f"  {a.describe()}" for a in alarms]
    restarts = [e for e in events if e["event"] == "restart"]
    lines.append(f"restarts: {len(restarts)}")
    lines += [f"  restart {e['restart']}: {e['cause']}" for e in restarts]
    return "\n".join(lines), alarms


def panel_of(metric: str) -> str:
    """The plotted signal an alarm on `metric` is marked on (memory growth on resident memory; the first otherwise)."""
    plotted = [k for k, _, _ in PLOTTED]
    metric = "rss_bytes" if metric == "rss_growth_bytes" else metric
    return metric if metric in plotted else plotted[0]


def plot_health(run_dir: str | Path, alarms: list[Alarm], path: str | Path) -> Path:
    """One panel per signal (PLOTTED), one line per worker (a band of the others beyond 16 workers, alarmed ones
    as lines), a marker at every alarm on its worker's line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in read_worker_records(run_dir) if r["step"] >= 1]
    n = max(len(r["workers"]) for r in records)
    steps = np.array([r["step"] for r in records])
    alarmed = sorted({a.rank for a in alarms})
    fig, axes = plt.subplots(2, 3, figsize=(16, 8), sharex=True)
    colors = plt.get_cmap("tab10")
    for ax, (key, _, title) in zip(axes.flat, PLOTTED):
        scale = 2**20 if key == "rss_bytes" else 1
        values = np.array(
            [
                [
                    (r["workers"][w] or {}).get(key, np.nan) / scale if w < len(r["workers"]) else np.nan
                    for w in range(n)
                ]
                for r in records
            ]
        )
        shown = range(n) if n <= 16 else alarmed
        if n > 16:
            ax.fill_between(
                steps, np.nanmin(values, axis=1), np.nanmax(values, axis=1), color="0.8", label=f"{n} workers"
            )
        for w in shown:
            ax.plot(steps, values[:, w], lw=0.8, color=colors(w % 10), label=f"worker {w}")
        for a in alarms:
            ax.axvline(a.step, color="red", alpha=0.15, lw=1)
            row = np.searchsorted(steps, a.step)
            if panel_of(a.metric) == key and row < len(steps):
                ax.plot(
                    a.step,
                    values[row, a.rank] if np.isfinite(values[row, a.rank]) else np.nanmedian(values[row]),
                    "x",
                    color="red",
                    ms=9,
                    mew=2,
                )
        ax.set_title(title)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    axes.flat[0].legend(fontsize=7, loc="best")
    fig.suptitle(f"{run_dir}: {len(alarms)} alarms (red lines; x: the worker named, on the metric that named it)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return Path(path)
