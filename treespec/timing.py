"""The one median timer (`median_seconds`: how long a call takes, as the median of repeated
wall-clock runs) and the one watch on the rest of the machine (`CpuWatch`: whether other
processes were busy while something was measured)."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable


def median_seconds(
    run: Callable[[], object],
    repeats: int,
    warmup: int = 1,
    *,
    sync: Callable[[], object] | None = None,
    between: Callable[[], object] | None = None,
    stop_above: float = float("inf"),
) -> float:
    """The median wall time of `repeats` calls of `run()`, after `warmup` untimed ones.

    `sync`: called just before the clock starts and just before it stops (a device's queue
    drained, e.g. `torch.cuda.synchronize`), so that the time is the work's and not its
    launch's. `between`: called untimed after each call (e.g. to undo what `run` left in a
    cache). `stop_above`: a timed call taking longer than this many seconds ends the
    measurement at once and its time is returned (what is that slow is not worth timing
    further)."""
    if repeats < 1:
        raise ValueError(f"median_seconds needs repeats >= 1, got {repeats}")
    times = []
    for i in range(warmup + repeats):
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        run()
        if sync is not None:
            sync()
        seconds = time.perf_counter() - t0
        if between is not None:
            between()
        if i < warmup:
            continue
        if seconds > stop_above:
            return seconds
        times.append(seconds)
    return statistics.median(times)


BUSY_SHARE = 0.15  # other processes taking more of the CPUs than this make a measurement unfit to keep
MIN_WATCH_SECONDS = 1.0
# what was measured on a busy machine is kept this long only: processes started together still
# decide alike, and later ones measure again
BUSY_KEEP_SECONDS = 3600  # a shorter watch says nothing: too few clock ticks to count


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks since boot of the CPUs this process may run on (Linux
    /proc/stat; None elsewhere): in a container on a larger machine, the others' CPUs do not
    count."""
    mine = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    busy = total = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *values = line.split()
                if not name.startswith("cpu") or name == "cpu":
                    continue
                if mine is not None and int(name[3:]) not in mine:
                    continue
                ticks = [int(v) for v in values] + [0] * 8
                user, nice, system, idle, iowait, irq, softirq, steal = ticks[:8]
                spent = user + nice + system + irq + softirq + steal
                busy, total = busy + spent, total + spent + idle + iowait
    except (OSError, ValueError):
        return None
    return (busy, total) if total else None


class CpuWatch:
    """What other processes took of this machine's CPUs while a block ran, so that a measurement
    a busy machine distorted is not kept as this machine's:

        with CpuWatch() as watch:
            measure()
        if watch.busy: ...   # `others`: their share of all CPUs' time, 0 .. 1

    This process's own threads are not counted (its CPU time is taken out of the machine's).
    Where the system's counters are not readable, or the block was too short to judge
    (MIN_WATCH_SECONDS), `others` is None and `busy` False."""

    def __init__(self, threshold: float = BUSY_SHARE):
        self.threshold = threshold
        self.others: float | None = None

    def __enter__(self) -> CpuWatch:
        self._start = (_cpu_ticks(), _own_seconds(), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        ticks, own, wall = _cpu_ticks(), _own_seconds(), time.perf_counter()
        (ticks0, own0, wall0) = self._start
        if ticks is None or ticks0 is None or wall - wall0 < MIN_WATCH_SECONDS:
            return
        hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        busy, total = ticks[0] - ticks0[0], ticks[1] - ticks0[1]
        if total > 0:
            self.others = min(1.0, max(0.0, (busy - (own - own0) * hz) / total))

    @property
    def busy(self) -> bool:
        return self.others is not None and self.others > self.threshold

    def describe(self) -> str:
        return "unknown" if self.others is None else f"{self.others:.0%}"


def _own_seconds() -> float:
    """CPU seconds this process has used, all its threads (user + system)."""
    t = os.times()
    return t.user + t.system
