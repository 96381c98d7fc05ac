"""The one median timer: how long a call takes, as the median of repeated wall-clock runs."""

from __future__ import annotations

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
