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


def load_prompts(path: str | Path | None = None, n: int | None = None) -> list[str]:
    """Prompts from a JSON file: a list of strings, or {"prompts": [{"text": ...}, ...]}.

    Default: the held-out prompts of the bundled pair (files never trained on).
    """
    import json

    path = Path(path) if path is not None else ZOO / "pycode" / "heldout_prompts.json"
    try:
        data = json.loads(path.read_text())
        items = data["prompts"] if isinstance(data, dict) else data
        prompts = [p["text"] if isinstance(p, dict) else p for p in items]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read prompts from {path}: {e}") from e
    prompts = prompts[:n] if n is not None else prompts
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError(f"{path} must hold a non-empty list of non-empty prompt strings")
    return prompts
