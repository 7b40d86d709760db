"""Restarts after a lost worker, for the modes whose controller outlives its workers (local, Ray)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from allsync.health.detector import append_health
from allsync.launch.group import WorkerFailure


def supervise(config, resume: bool, make_group: Callable, train: Callable, out_dir: Path) -> int:
    """`train(group, resume, own)` with workers from `make_group(attempt)`. A lost worker (it raised, its process
    died, or the step passed run.step_timeout) stops every worker; up to run.max_restarts times new workers resume
    from the newest good checkpoint (or start over when the run has none yet), each restart logged with its cause
    in health.jsonl. Exit code 4 when a worker is lost once more than that."""
    restarts, own = 0, set()  # the checkpoints this run loaded or wrote: a restart resumes from one of them
    while True:
        group = make_group(restarts)
        try:
            return train(group, resume, own)
        except WorkerFailure as exc:
            cause = str(exc).splitlines()[0][:500]
            if restarts >= config.run.max_restarts:
                print(
                    f"{exc.__cause__}\nerror: {exc}; every worker was stopped", file=sys.stderr
                )  # the cause holds the worker's traceback
                return 4
            restarts += 1
            resume = bool(own)
            append_health(out_dir, {"event": "restart", "time": time.time(), "restart": restarts, "cause": cause})
            print(
                f"warning: {exc}; every worker was stopped. Restart {restarts} of run.max_restarts = {config.run.max_restarts}: "
                f"new workers {'resume from the newest good checkpoint' if resume else 'start the run over'}",
                file=sys.stderr,
            )
        finally:
            group.shutdown()
