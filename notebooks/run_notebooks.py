#!/usr/bin/env python
"""Execute the notebooks with nbclient.

    python notebooks/run_notebooks.py                 # full run: outputs written back (what is committed)
    python notebooks/run_notebooks.py 03_sequoia      # one notebook
    TREESPEC_FAST=1 python notebooks/run_notebooks.py --no-write   # what tests/test_notebooks.py does
    python notebooks/run_notebooks.py --figures-only  # re-export figures from the committed outputs

A full run also writes every figure of a notebook to notebooks/figures/<notebook>_fig<k>.png
(the README's "Results" section shows some of them).

Each notebook runs with the notebooks/ directory as its working directory (it imports helpers.py).
Run heavy jobs with `nice -n 19`; torch uses TREESPEC_THREADS threads (default 1).
"""

from __future__ import annotations

import argparse
import base64
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
FIGURES = HERE / "figures"


def notebooks(names=()) -> list[Path]:
    found = sorted(HERE.glob("[0-9][0-9]_*.ipynb"))
    return [p for p in found if not names or any(p.stem.startswith(n) or p.name == n for n in names)]


def execute(path: Path, write: bool = False, timeout: int = 1800) -> nbformat.NotebookNode:
    """Run every cell of `path` (raises nbclient's CellExecutionError on any error)."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    if write:
        nbformat.write(nb, path)
    return nb


def export_figures(nb: nbformat.NotebookNode, path: Path) -> list[Path]:
    """Write the PNG outputs of `nb`, in order, to notebooks/figures/<stem>_fig<k>.png."""
    FIGURES.mkdir(exist_ok=True)
    for old in FIGURES.glob(f"{path.stem}_fig*.png"):
        old.unlink()
    written = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            png = out.get("data", {}).get("image/png")
            if png:
                written.append(FIGURES / f"{path.stem}_fig{len(written) + 1}.png")
                written[-1].write_bytes(base64.b64decode(png))
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="notebook name prefixes (default: all)")
    ap.add_argument("--no-write", action="store_true", help="do not write the outputs (or figures) back")
    ap.add_argument("--figures-only", action="store_true", help="only export the figures of the saved outputs")
    args = ap.parse_args()
    for path in notebooks(args.names):
        if args.figures_only:
            nb = nbformat.read(path, as_version=4)
        else:
            t0 = time.perf_counter()
            nb = execute(path, write=not args.no_write)
            print(f"{path.name}: {time.perf_counter() - t0:.1f} s", flush=True)
        if args.figures_only or not args.no_write:
            print(f"{path.name}: figures {', '.join(p.name for p in export_figures(nb, path))}", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
