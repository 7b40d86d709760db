"""Running Triton kernels' checks on CPU: Triton's interpreter (TRITON_INTERPRET=1) must be chosen before Triton is
first imported, which the test process may have done already, so the checks run in a fresh interpreter, all of a
test file's in one (each start imports torch and transformers again)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RUNNER = """
import json, sys, traceback
import {module} as cases
failures = {{}}
for name, call in json.loads(sys.argv[1]).items():
    try:
        eval(call, vars(cases))
    except Exception:
        failures[name] = traceback.format_exc()[-3000:]
print("INTERPRETED " + json.dumps(failures))
"""


def run_interpreted(module: str, calls: dict[str, str]) -> dict[str, str]:
    """Each of `calls` (name -> an expression over `module`'s names) in one fresh Python with TRITON_INTERPRET=1;
    returns the tracebacks of those that failed, by name (a failure to start fails here, with its stderr)."""
    done = subprocess.run(
        [sys.executable, "-c", RUNNER.format(module=module), json.dumps(calls)],
        cwd=ROOT,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("INTERPRETED ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("INTERPRETED "))
