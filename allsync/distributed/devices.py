"""The device a worker runs on, and the host memory it reuses."""

from __future__ import annotations

import os

import torch


def worker_device(device: str, launcher: bool) -> torch.device:
    """cpu, or this worker's GPU: cuda:LOCAL_RANK under a launcher (one process per GPU), cuda:0 under Ray
    (the actor sees only the GPU its bundle holds)."""
    if device == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", 0)) if launcher else 0
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


KEPT_FREE_BYTES = 2**30  # the most freed heap one worker keeps for reuse (M_TRIM_THRESHOLD)


def kept_free_bytes(processes: int, host_bytes: int) -> int:
    """The freed heap each of `processes` workers on one machine keeps for reuse: KEPT_FREE_BYTES, and at most an
    eighth of the machine's memory over all of them, min(1 GiB, host / (8 * processes)): 2 workers on 24 GiB keep
    1 GiB each, 16 workers 192 MiB each (at 1 GiB each, 16 workers could keep 16 GiB idle between them)."""
    return min(KEPT_FREE_BYTES, host_bytes // (8 * max(processes, 1)))


def keep_freed_host_memory(processes: int = 1) -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of handing it back to the system at once
    (mallopt: M_MMAP_THRESHOLD 32 MiB, its 64-bit maximum, and M_TRIM_THRESHOLD kept_free_bytes: up to 1 GiB for
    one worker, less where `processes` workers share the machine). A CPU worker allocates and frees activations of
    a few MiB many times per step; by default each comes from a fresh mmap whose pages fault in again: 10% of the
    default step (benchmarks/step_profile.py). Returns False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 32 * 2**20)) and bool(
        mallopt(m_trim_threshold, kept_free_bytes(processes, host))
    )
