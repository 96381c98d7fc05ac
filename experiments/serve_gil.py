#!/usr/bin/env python
"""Does the event loop need the engine in another process? /health latency while the engine
thread's steps hold the engine's lock for 0.5 s, asleep (as in a torch op, which releases the
GIL) or spinning in Python (the GIL held throughout), against an idle engine. In process:
the tests' tiny Llamas behind a real uvicorn on loopback (tests/test_serve_load.py's harness).

    python experiments/serve_gil.py          # docs/serving.md, "The event loop never waits on the engine"
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests/
from tests import test_serve_load as harness  # noqa: E402

MODES = (("idle", 0.0, False), ("asleep (GIL released)", 0.5, False), ("spinning (GIL held)", 0.5, True))


def main() -> None:
    print(f"sys.getswitchinterval() = {sys.getswitchinterval()}")
    for name, seconds, busy in MODES:
        app = harness.make_app()
        slow = harness.SlowSteps(app.state.server.engine, seconds, busy)
        with harness.serving(app) as base:
            if seconds:
                events, started = [], threading.Event()
                args = (base, harness.LONG, events, started)
                threading.Thread(target=harness.stream_events, args=args, daemon=True).start()
                started.wait(30)
            lat = []
            with httpx.Client(base_url=base) as c:
                for _ in range(40):
                    t0 = time.perf_counter()
                    c.get("/health")
                    lat.append(time.perf_counter() - t0)
                    time.sleep(0.05)
            slow.seconds = 0.0
        lat.sort()
        print(
            f"engine {name}: /health median {statistics.median(lat) * 1e3:.1f} ms, "
            f"p90 {lat[int(0.9 * len(lat))] * 1e3:.1f} ms, max {lat[-1] * 1e3:.1f} ms"
        )


if __name__ == "__main__":
    main()
