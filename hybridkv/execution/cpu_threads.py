"""How many torch threads an engine step runs with on the CPU.

A step on the CPU is many short operations, and each one parallel over torch's threads ends at a
barrier: when another process holds one of the cores, every barrier waits for the thread that lost its
core. Measured on 2 cores with one kept busy: 2 threads ran the hybrid workload slower than 1 thread did
(benchmarks/RESULTS.md, 'Choices in the code'). So with ``cpu_threads="auto"`` (the default) an engine
watches how much CPU other processes use (Linux: /proc/stat, less this process's own time, sampled at
most five times a second) and runs its steps on the cores they leave, never more threads than torch had
when the engine was made; between steps torch's own setting is back, so code around the engine sees
the thread count it set. A number fixes the steps' thread count; None leaves torch alone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

SAMPLE_SECONDS = 0.2


def threads_for(num_cores: int, others_busy_cores: float, cap: int) -> int:
    """Threads for a step: the cores other processes leave free (rounded), at least 1, at most ``cap``."""
    return max(1, min(cap, round(num_cores - others_busy_cores)))


def read_proc_stat() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, of this process), or None where /proc/stat is missing."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in fields[1:9])
    times = os.times()
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), times.user + times.system


class StepThreads:
    """The thread count of an engine's steps: ``with step_threads:`` sets it around a step and puts torch's back.

    ``setting`` is "auto", a positive int, or None (see the module's docstring). ``read`` and ``clock``
    are the machine's by default; tests pass their own.
    """

    def __init__(
        self,
        setting: int | str | None,
        read: Callable[[], tuple[float, float] | None] = read_proc_stat,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.setting = setting
        self.cap = torch.get_num_threads()
        self.num_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self._read, self._clock = read, clock
        self._last = (clock(), read()) if setting == "auto" else None
        self.threads = setting if isinstance(setting, int) else self.cap
        self.others_busy_cores = 0.0
        self._outside = self.cap  # torch's thread count outside the step under way

    def __enter__(self) -> None:
        """A step begins: its thread count set (a class's own `__enter__`, two calls a step where a generator-based
        context manager makes five)."""
        if self.setting is None:
            return
        if self.setting == "auto":
            self._sample()
        self._outside = torch.get_num_threads()
        if self.threads != self._outside:
            torch.set_num_threads(self.threads)

    def __exit__(self, *exc_info: object) -> None:
        """The step ended, however: torch's own thread count back."""
        if self.setting is not None and self.threads != self._outside:
            torch.set_num_threads(self._outside)

    def _sample(self) -> None:
        now = self._clock()
        last_time, last_reading = self._last
        if now - last_time < SAMPLE_SECONDS:
            return
        reading = self._read()
        self._last = (now, reading)
        if reading is None or last_reading is None:
            return
        machine_busy = reading[0] - last_reading[0]
        ours = reading[1] - last_reading[1]
        self.others_busy_cores = max(0.0, (machine_busy - ours) / (now - last_time))
        self.threads = threads_for(self.num_cores, self.others_busy_cores, self.cap)
