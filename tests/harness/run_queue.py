"""How long a process's threads waited for a CPU: what a busy machine, not the process itself, cost it.

The second field of /proc/PID/task/TID/schedstat is the nanoseconds the thread spent runnable on a run queue
without a CPU (the kernel's Documentation/scheduler/sched-stats.rst). A loop that blocks on a read sleeps and adds
nothing to it; a loop the machine starves (CI runs a CPU vLLM beside the tests on two cores) adds what it lost. The
timing checks subtract it, so that they catch the daemon's own stalls and not the machine's.
"""

import os
import subprocess
import time


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


class CpuWait:
    """One process's wait for a CPU since this was made. A process that has ended reads 0.0 in /proc: the last
    reading taken while it lived stands, so read it (since()) while it runs where its end is what is timed."""

    def __init__(self, pid: int):
        self.pid = pid
        self.start = self.last = cpu_wait_s(pid)

    def since(self) -> float:
        self.last = max(self.last, cpu_wait_s(self.pid))
        return self.last - self.start

    def wait_exit(self, proc, timeout: float) -> int:
        """proc's exit status (subprocess.TimeoutExpired past timeout), reading the wait until its last moment."""
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            self.since()
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(proc.args, timeout)
            time.sleep(0.02)
        return proc.returncode
