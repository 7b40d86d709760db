"""What a CPU worker keeps of its freed heap (allsync/distributed/devices.py): enough for one worker to reuse its
activations, never so much that the workers sharing a machine keep more than an eighth of it idle between them."""

import subprocess
import sys

from allsync.distributed.devices import KEPT_FREE_BYTES, kept_free_bytes

GIB = 2**30


def test_the_kept_heap_shrinks_with_the_workers_on_the_machine():
    assert kept_free_bytes(1, 24 * GIB) == kept_free_bytes(2, 24 * GIB) == KEPT_FREE_BYTES == GIB
    assert kept_free_bytes(16, 24 * GIB) == 24 * GIB // 128  # 192 MiB each: 3 GiB in all
    for workers in (1, 2, 4, 8, 16, 64):
        assert workers * kept_free_bytes(workers, 24 * GIB) <= 3 * GIB
    assert kept_free_bytes(0, 8 * GIB) == GIB  # no count given: one worker


def test_a_worker_process_hands_back_what_it_does_not_keep():
    """A process that frees 600 MiB of 4 MiB blocks keeps at most what it may (plus slack) when it shares the
    machine with enough workers that this is under 300 MiB (16 on 24 GiB)."""
    code = """
import os
from allsync.distributed.devices import keep_freed_host_memory, kept_free_bytes
host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
workers = host // (8 * 300 * 2**20) + 1
assert keep_freed_host_memory(workers)
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
before = rss()
blocks = [bytearray(4 * 2**20) for _ in range(150)]  # 600 MiB of 4 MiB blocks: heap, under M_MMAP_THRESHOLD
del blocks
kept = rss() - before
print(kept, kept_free_bytes(workers, host))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    kept, allowed = map(int, done.stdout.split())
    assert allowed < 600 * 2**20 and kept <= allowed + 64 * 2**20, (kept, allowed)
