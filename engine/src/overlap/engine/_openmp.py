"""Imported first by `overlap.engine`: OpenMP settings that must be in place before torch loads.

A decode step opens a parallel region per projection and per layer's attention, well over a hundred per step, with a
few tens of microseconds of Python between them. How libgomp's idle worker waits for the next region decides what
each costs:
- libgomp's default spins for a long time. When the CPU is shared with other processes (a pod next to others, a
  laptop, CI), a spinning worker steals the core its peer needs and every barrier waits for a descheduled thread: a
  2-thread decode step of the tiny model measured 1.4 s instead of 0.09 s at batch 64 on a busy 2-core machine.
- Passive waiting (OMP_WAIT_POLICY=PASSIVE) removes that cliff but pays a futex wake per region, a sizeable share of
  a decode step at real model sizes.
- A short bounded spin (GOMP_SPINCOUNT, counted in pause instructions) covers the gap between two regions of one step
  and then sleeps, so a busy machine loses at most that spin per region. docs/engine.md ("Between the kernels")
  has the measurements.
An explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment wins.
"""

import os

SPIN_COUNT = "3000"

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = SPIN_COUNT
