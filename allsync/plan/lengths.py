"""Response lengths for a plan's step time: measured ones from a file, or a parametric long tail.

    --response-lengths FILE                          one length per line, or a JSON list (e.g. a run's lengths)
    --response-lengths lognormal:median=M,sigma=S    exp(N(ln M, S^2)), the long tail RL responses have

Either way each GPU draws its own sequences (numpy's generator, seed 0, so a plan is reproducible) and lengths are
clipped to [1, rollout.max_new_tokens]: a response that reaches the cap is cut there, as the engine cuts it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_LENGTHS = "lognormal:median=6000,sigma=0.8"  # assumed: mean 8,260 tokens, 6% of 20,480-token responses cut


@dataclass(frozen=True)
class ResponseLengths:
    description: str
    median: float = 0.0
    sigma: float = 0.0
    measured: tuple[int, ...] = ()

    def draw(self, count: int, cap: int, rng: np.random.Generator) -> np.ndarray:
        if self.measured:
            values = rng.choice(np.asarray(self.measured), size=count, replace=True)
        else:
            values = rng.lognormal(np.log(self.median), self.sigma, size=count)
        return np.clip(np.rint(values), 1, cap).astype(np.int64)


def parse_lengths(text: str) -> ResponseLengths:
    """`--response-lengths`: a file of lengths, or `lognormal:median=M,sigma=S`. ValueError naming the flag."""
    if text.startswith("lognormal:"):
        try:
            params = dict(item.split("=", 1) for item in text.removeprefix("lognormal:").split(","))
            median, sigma = float(params.pop("median")), float(params.pop("sigma"))
        except (KeyError, ValueError) as e:
            raise ValueError(f"--response-lengths {text!r}: expected lognormal:median=M,sigma=S") from e
        if params or not (math.isfinite(median) and median >= 1 and math.isfinite(sigma) and sigma >= 0):
            raise ValueError(f"--response-lengths {text!r}: expected lognormal:median=M,sigma=S with M >= 1, S >= 0")
        return ResponseLengths(text, median=median, sigma=sigma)
    path = Path(text)
    if not path.is_file():
        raise ValueError(f"--response-lengths {text!r}: no such file (or lognormal:median=M,sigma=S)")
    raw = path.read_text()
    try:
        values = json.loads(raw) if raw.lstrip().startswith("[") else [float(v) for v in raw.split()]
    except ValueError as e:
        raise ValueError(f"--response-lengths {text}: not a JSON list or one number per line ({e})") from e
    if not values or any(not isinstance(v, (int, float)) or not math.isfinite(v) or v < 1 for v in values):
        raise ValueError(f"--response-lengths {text}: needs at least one length, every one a finite number >= 1")
    return ResponseLengths(f"{len(values)} lengths from {text}", measured=tuple(int(v) for v in values))
