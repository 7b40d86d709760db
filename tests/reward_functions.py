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
