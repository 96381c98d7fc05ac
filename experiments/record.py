"""Where the experiment scripts keep what they measured: experiments/results/<name>."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def write_results(name: str, data) -> Path:
    """`data` as JSON in results/`name` (indented, a final newline), said on stdout."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}")
    return path
