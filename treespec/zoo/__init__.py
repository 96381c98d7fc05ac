"""Checkpoints shipped inside the package, so treespec runs with no model hub.

`pycode/target` and `pycode/draft`: a Llama-architecture pair trained on the Python standard
library (see `pycode/README.md` and `experiments/train_pycode_pair.py`).
"""

from __future__ import annotations

from pathlib import Path

ZOO = Path(__file__).resolve().parent


def default_pair() -> tuple[Path, Path]:
    """(target, draft) directories of the bundled pair."""
    target, draft = ZOO / "pycode" / "target", ZOO / "pycode" / "draft"
    for d in (target, draft):
        if not (d / "config.json").is_file():
            raise ValueError(
                f"the bundled model {d} is missing; reinstall treespec, or pass target=/draft= "
                f"(HF ids or local directories)"
            )
    return target, draft
