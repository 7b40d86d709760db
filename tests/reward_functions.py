"""User reward functions the tests name in `reward.function` (imported by the reward processes)."""

import time


def broken(response: str, row: dict) -> float:
    raise ZeroDivisionError("bad verifier")


def sleeps(response: str, row: dict) -> float:
    time.sleep(60)
    return 1.0


def length_bonus(response: str, row: dict) -> dict:
    print("user code may print; it goes to stderr")
    return {"score": 1.0 if row["answer"] in response else -0.5, "length": len(response)}


def echoes(response: str, row: dict) -> float:
    """Writes to the process's real stdout three ways: a child process, C-level os.write, Python's print."""
    import os
    import subprocess

    subprocess.run(["echo", "[1.0, null]"], check=True)
    os.write(1, b"[1.0, null]\n")
    print("[1.0, null]", flush=True)
    return 0.0


def reads_stdin(response: str, row: dict) -> float:
    """User code that reads standard input: it must get nothing, not the next sample."""
    import sys

    return float(len(sys.stdin.read()))


def not_finite(response: str, row: dict) -> float:
    return float(response)


def slow_or_dies_when_asked(response: str, row: dict) -> float:
    """1.0, except that "slow" never returns and "die" ends the reward process."""
    import os

    if response == "slow":
        time.sleep(60)
    if response == "die":
        os._exit(3)
    return 1.0
