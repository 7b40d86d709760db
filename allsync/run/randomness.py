"""A worker's random streams: python's, numpy's and torch's seeded together, and a stream of its own for evaluation."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """python, numpy and torch (every device) generators from one seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def own_random_stream(seed: int, device: torch.device):
    """Draws inside come from `seed` (python, numpy, torch on `device`), and the run's generators are as they were
    afterwards: what runs inside (an evaluation) never moves the training samples, so a run stopped with --steps N
    (evaluated at N) and resumed samples what a run that never stopped samples."""
    python, numpy = random.getstate(), np.random.get_state()
    devices = [device.index] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        seed_everything(seed)
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy)
