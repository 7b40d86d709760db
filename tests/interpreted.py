"""Running Triton kernels' checks on CPU: Triton's interpreter (TRITON_INTERPRET=1) must be chosen before Triton is
first imported, which the test process may have done already, so the checks run in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(module: str, call: str) -> None:
    """`call` (an expression over `module`'s names) in a fresh Python with TRITON_INTERPRET=1; fails with its stderr."""
    done = subprocess.run(
        [sys.executable, "-c", f"from {module} import *; {call}"],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
