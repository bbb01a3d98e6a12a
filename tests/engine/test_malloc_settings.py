"""`overlap.engine` makes glibc keep a step's freed buffers once the model is loaded, so the next step does not fault
their pages in again, gives back what the load freed, and leaves an allocator choice the user made alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# A 64 MB buffer (over glibc's largest mmap threshold) allocated, written and freed on a thread, as the engine's step
# thread does with a prefill's activations; prints the minor page faults of the last four of 16 rounds. The first
# rounds may still fault: torch's aligned allocations do not fit the chunk the last one freed until freed neighbours
# merge (glibc before 2.38), so the heap settles a few buffers larger than one.
FAULTS = """
import resource, threading, overlap.engine, torch
from overlap.engine import _malloc
_malloc.keep_freed_memory()  # as the runner does once the weights are loaded
def steps():
    for round_ in range(16):
        if round_ == 12:
            global before
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(16 << 20)
thread = threading.Thread(target=steps)
thread.start()
thread.join()
print(_malloc.KEPT, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(extra: dict[str, str]) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"} | extra
    kept, faults = subprocess.run([sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True,
                                  check=True).stdout.split()  # fmt: skip
    return kept, int(faults)


def test_a_step_reuses_its_freed_buffers_without_faulting_them_in():
    kept, faults = _run({})
    assert kept == "True"
    assert faults < 1000  # 4 x 16384 pages were it mapped afresh each round


def test_an_allocator_setting_in_the_environment_wins():
    kept, faults = _run({"MALLOC_ARENA_MAX": "2"})
    assert kept == "False"
    assert faults > 4 * 16384 * 0.9  # glibc's default: every round maps the buffer afresh


# Half of 48 buffers of 8 MB (a load's temporaries between the weights it keeps) freed on the heap of one arena, with
# mmap off as after a load; prints the anonymous resident kB before and after keep_freed_memory().
TRIM = """
import ctypes, overlap.engine, torch
from overlap.engine import _malloc
def anon():
    return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon")).split()[1])
ctypes.CDLL(None).mallopt(-4, 0)
buffers = [torch.ones(2 << 20) for _ in range(48)]
del buffers[::2]
before = anon()
print(_malloc.keep_freed_memory(), before, anon())
"""


def test_what_the_load_freed_is_given_back_once_it_is_loaded():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    kept, before, after = subprocess.run([sys.executable, "-c", TRIM], env=env, capture_output=True, text=True,
                                         check=True).stdout.split()  # fmt: skip
    assert kept == "True"
    assert int(before) - int(after) > 0.8 * 24 * 8192  # kB: the 24 freed buffers
