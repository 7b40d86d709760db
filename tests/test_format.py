"""The code is formatted by the formatter pyproject.toml declares (`ruff format`, line length 120)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_code_is_ruff_formatted():
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, f"run `ruff format .` (it would reformat):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
