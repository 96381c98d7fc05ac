"""Every notebook in notebooks/ runs without error in fast mode (TREESPEC_FAST=1).

nbclient executes the cells on the "python3" kernel of this environment (ipykernel, a dev
dependency), with notebooks/ as the working directory; nothing is written back, so the
committed outputs stay those of the full run (`python notebooks/run_notebooks.py`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
sys.path.insert(0, str(NOTEBOOKS))
from run_notebooks import execute, notebooks  # noqa: E402

# 01, 02 and 03 take 20-30 s each even in fast mode: they run with -m slow; 04 (~9 s) keeps a
# notebook execution in the default run.
SLOW_NOTEBOOKS = ("01_leviathan", "02_multidraft", "03_sequoia")


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=pytest.mark.slow) if p.stem in SLOW_NOTEBOOKS else p for p in notebooks()],
    ids=lambda p: p.stem,
)
def test_notebook_runs_in_fast_mode(path, monkeypatch):
    monkeypatch.setenv("TREESPEC_FAST", "1")
    monkeypatch.setenv("TREESPEC_THREADS", "1")
    nb = execute(path, write=False, timeout=600)
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"
    ]
    assert not errors, [f"{e.ename}: {e.evalue}" for e in errors]


def test_all_notebooks_found():
    assert [p.stem[:2] for p in notebooks()] == ["01", "02", "03", "04"]
