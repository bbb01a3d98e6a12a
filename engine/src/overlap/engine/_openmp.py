"""Imported first by `overlap.engine`: OpenMP settings that must be in place before torch loads.

libgomp's default waits at each parallel region's barrier by spinning. When the CPU is shared with other processes
(a pod next to others, a laptop, CI), a spinning worker steals the core its peer needs and every barrier waits for a
descheduled thread: a 2-thread decode step of the tiny model measured 1.4 s instead of 0.09 s at batch 64 on a busy
2-core machine. Passive waiting costs a futex wake per region (tens of microseconds) and removes that cliff. An
explicit OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment wins.
"""

import os

if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
