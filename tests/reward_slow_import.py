"""A reward module that takes 2 s to import (as a reward that loads a model or a large library does): its reward
process imports it before it says it is ready, so the import is not its first sample's time."""

import time

time.sleep(2.0)


def one(response: str, row: dict) -> float:
    return 1.0
