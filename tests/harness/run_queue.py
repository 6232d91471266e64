"""How long a process's threads waited for a CPU: what a busy machine, not the process itself, cost it.

The second field of /proc/PID/task/TID/schedstat is the nanoseconds the thread spent runnable on a run queue
without a CPU (the kernel's Documentation/scheduler/sched-stats.rst). A loop that blocks on a read sleeps and adds
nothing to it; a loop the machine starves adds what it lost. benchmarks/soak.py records it beside the daemon's loop
lag. The tests do not excuse a wait with it: they assert order and outcome, and prove timing rules on the clock the
test drives (docs/development.md).
"""

import os


def cpu_wait_s(pid: int) -> float:
    """Seconds the process's threads have waited for a CPU, summed over the threads alive now (0.0 for a process
    that is gone or a kernel without the figure)."""
    total = 0
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended while we looked
    return total / 1e9
