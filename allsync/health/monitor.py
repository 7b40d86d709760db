"""Per-worker health signals, sampled once per RL step: process CPU use and resident memory (psutil), and on
GPUs the device's utilization, power, memory and temperature (NVML through nvidia-ml-py).

The worker adds these to its step report beside its phase times (`Timeline`), tokens/s, loss,
local gradient norm and logprob gap; the controller writes them to workers.jsonl and TensorBoard and feeds
them to the detector (allsync/health/detector.py). One sample costs two system calls (and four NVML queries on a
GPU); `probe_seconds` reports what it cost, so the overhead is measured, not assumed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import psutil
import torch

EVENTS_KEPT = 4096  # the most recent phases kept for inspection (benchmarks); busy time is a running total


@dataclass
class Timeline:
    """Phases as (phase, start, end) in wall-clock seconds, and busy time: the time inside phases minus
    the time blocked in the process groups' collectives (allsync.distributed.process_groups.Groups: the learner's
    all-reduces, waiting for other workers plus the transfer itself; the MoE all-to-alls of expert parallelism run
    inside forward and backward and stay busy time). A worker that
    finishes its share first and waits in the all-reduce for a slower one is idle for that wait, so
    busy / wall is the worker's real utilization. Per phase, busy seconds and the waits inside the phases
    accumulate until `phase_report` (once per step). O(1) per phase."""

    events: deque = field(default_factory=lambda: deque(maxlen=EVENTS_KEPT))
    busy_total: float = 0.0
    reported: float = 0.0  # busy_total at the last `busy_since_last_report`
    pending_wait: float = 0.0  # waits since the last phase ended: they belong to the phase being timed
    phase_busy: dict = field(default_factory=dict)
    phase_wait: float = 0.0

    def record(self, phase: str, start: float) -> float:
        end = time.time()
        self.events.append((phase, start, end))
        self.busy_total += end - start
        self.phase_busy[phase] = self.phase_busy.get(phase, 0.0) + (end - start) - self.pending_wait
        self.phase_wait += self.pending_wait
        self.pending_wait = 0.0
        return end

    def waited(self, seconds: float) -> None:
        """Time spent blocked in a collective inside a phase: not busy."""
        self.busy_total -= seconds
        self.pending_wait += seconds

    def busy_since_last_report(self) -> float:
        busy, self.reported = self.busy_total - self.reported, self.busy_total
        return busy

    def phase_report(self, phases: tuple[str, ...] = ("generate", "train", "sync")) -> dict:
        """{<phase>_seconds: busy seconds in it, wait_seconds: blocked in collectives} since the last report."""
        out = {f"{p}_seconds": self.phase_busy.get(p, 0.0) for p in phases}
        out["wait_seconds"] = self.phase_wait
        self.phase_busy, self.phase_wait = {}, 0.0
        return out


def nvml_handle(device: torch.device):
    """NVML's handle of the GPU behind `device` (found by UUID, so CUDA_VISIBLE_DEVICES cannot mislead it),
    or None on CPU."""
    if device.type != "cuda":
        return None
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")


def gpu_sample(handle) -> dict:
    """NVML's readings of the GPU. A reading the driver refuses (NVMLError: virtualized GPUs may not report
    power or temperature) is left out, as on CPU, so the health detector skips that signal instead of the
    step failing."""
    import pynvml

    readings = {
        "gpu_utilization": lambda: float(
            pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
        ),  # percent of the last period
        "gpu_power_watts": lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
        "gpu_memory_bytes": lambda: float(pynvml.nvmlDeviceGetMemoryInfo(handle).used),
        "gpu_temperature_c": lambda: float(pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)),
    }
    out = {}
    for key, read in readings.items():
        try:
            out[key] = read()
        except pynvml.NVMLError:
            pass
    return out


class WorkerMonitor:
    """One worker's health signals: its Timeline, a ResourceProbe, and the reward-scoring time inside generation."""

    def __init__(self, device: torch.device):
        self.timeline = Timeline()
        self.probe = ResourceProbe(device)
        self.reward_seconds = 0.0  # reward scoring inside the generate phase since the last report
        self.last_rss: float | None = None

    def report(self, metrics: dict, engine_positions: int) -> dict:
        """The step's signals (allsync/health/detector.py): busy seconds per phase (reward scoring apart from generation)
        and blocked in collectives; token positions generated (`engine_positions`) and trained
        (metrics["train_positions"]) per busy second, the engine's and the trainer's padded work, or under expert
        parallelism the routed rows this rank's experts received per busy second (routing makes loads unequal);
        process CPU %, resident bytes and their growth since the last report; GPU readings on a GPU."""
        out = self.timeline.phase_report()
        out["reward_seconds"], self.reward_seconds = self.reward_seconds, 0.0
        out["generate_seconds"] = max(out["generate_seconds"] - out["reward_seconds"], 0.0)
        if "alltoall_received_rows" in metrics:
            out["routed_rows_per_second"] = metrics["alltoall_received_rows"] / max(
                out["generate_seconds"] + out["train_seconds"], 1e-9
            )
        else:
            out["generate_tokens_per_second"] = engine_positions / max(out["generate_seconds"], 1e-9)
            out["train_tokens_per_second"] = metrics.get("train_positions", 0) / max(out["train_seconds"], 1e-9)
        out.update(self.probe.sample())
        out["rss_growth_bytes"] = out["rss_bytes"] - (self.last_rss if self.last_rss is not None else out["rss_bytes"])
        self.last_rss = out["rss_bytes"]
        return out


class ResourceProbe:
    """`sample()`: CPU percent of this process since the previous sample (all its threads; 100 = one core),
    resident bytes, and the GPU's NVML readings when the worker runs on one."""

    def __init__(self, device: torch.device):
        self.process = psutil.Process()
        self.handle = nvml_handle(device)
        self.last_wall, self.last_cpu = time.time(), self._cpu_seconds()

    def _cpu_seconds(self) -> float:
        times = self.process.cpu_times()
        return times.user + times.system

    def sample(self) -> dict:
        t0 = time.perf_counter()
        wall, cpu = time.time(), self._cpu_seconds()
        out = {
            "cpu_percent": 100.0 * (cpu - self.last_cpu) / max(wall - self.last_wall, 1e-9),
            "rss_bytes": float(self.process.memory_info().rss),
        }
        self.last_wall, self.last_cpu = wall, cpu
        if self.handle is not None:
            out.update(gpu_sample(self.handle))
        out["probe_seconds"] = time.perf_counter() - t0
        return out
