#!/usr/bin/env python
"""One client's large trees against another's default request, over `treespec serve`.

    python experiments/serve_fairness.py --pair pycode --hog-tree 8 8 --tag zen5
    python experiments/serve_fairness.py --pair pycode --hog-tree 8 8 --shared-tree-nodes 64 --tag zen5

Starts a server (default flags), times a default greedy request (median of 7) alone, then
while two clients loop 200-token T=1 requests with the given i.i.d. tree (or plain decoding
with --hog-tree 0 0): issue 36's bar is the ratio <= 1.5. Writes
results/serve_fairness_<tag>.json (one entry per run; it appends).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default="pycode")
    ap.add_argument("--hog-tree", type=int, nargs=2, default=[8, 8], metavar=("WIDTH", "DEPTH"))
    ap.add_argument("--max-tree-nodes", type=int, default=64)
    ap.add_argument(
        "--shared-tree-nodes", type=int, default=None, help="the server's flag (default: its default)"
    )
    ap.add_argument("--tag", default="cpu")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "treespec.serve", "--pair", args.pair, "--dtype", "float32"]
    cmd += ["--port", str(port), "--log-level", "warning", "--max-tree-nodes", str(args.max_tree_nodes)]
    if args.shared_tree_nodes is not None:
        cmd += ["--shared-tree-nodes", str(args.shared_tree_nodes)]
    server = subprocess.Popen(cmd)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)

        def default_request() -> float:
            body = {"prompt": "def quicksort(xs):", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
            t0 = time.perf_counter()
            r = httpx.post(base + "/v1/completions", json=body, timeout=120)
            r.raise_for_status()
            return time.perf_counter() - t0

        for _ in range(3):
            default_request()
        alone = [default_request() for _ in range(7)]
        width, depth = args.hog_tree
        tree = None if width == 0 else {"width": width, "depth": depth, "strategy": "iid"}
        stop = threading.Event()

        def hog() -> None:
            body = {
                "prompt": "import os\n",
                "max_tokens": 200,
                "temperature": 1.0,
                "ignore_eos": True,
                "tree": tree,
            }
            while not stop.is_set():
                httpx.post(base + "/v1/completions", json=body, timeout=300).raise_for_status()

        hogs = [threading.Thread(target=hog) for _ in range(2)]
        for h in hogs:
            h.start()
        time.sleep(1.0)
        loaded = [default_request() for _ in range(7)]
        stop.set()
        for h in hogs:
            h.join()
    finally:
        server.terminate()
        server.wait()
    record = {
        "pair": args.pair,
        "hog_tree": args.hog_tree,
        "shared_tree_nodes": args.shared_tree_nodes,
        "alone_s": round(statistics.median(alone), 3),
        "with_two_hogs_s": round(statistics.median(loaded), 3),
        "ratio": round(statistics.median(loaded) / statistics.median(alone), 2),
    }
    print(json.dumps(record))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"serve_fairness_{args.tag}.json"
    runs = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(runs + [record], indent=1) + "\n")


if __name__ == "__main__":
    main()
