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


def keep_freed_host_memory() -> bool:
    """Ask glibc's malloc to keep freed memory for reuse instead of handing it back to the system at once
    (mallopt: M_MMAP_THRESHOLD 32 MiB, its 64-bit maximum, and M_TRIM_THRESHOLD 1 GiB). A CPU worker allocates
    and frees activations of a few MiB many times per step; by default each comes from a fresh mmap whose pages
    fault in again: 10% of the default step (benchmarks/step_profile.py). The resident size stays at its
    high-water mark. Returns False where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 32 * 2**20)) and bool(mallopt(m_trim_threshold, 2**30))
