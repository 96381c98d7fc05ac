"""What a path names, decided once: a GGUF file, an EAGLE-3 head directory, a local model
directory or a hub id, and the model directory behind it (`checkpoint`)."""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path


class PathKind(str, Enum):
    GGUF = "gguf"  # a GGUF file, or a directory holding one and no config.json: converted once
    HEAD = "head"  # a local directory holding an EAGLE-3 head (`backends.head.is_head`)
    DIRECTORY = "directory"  # a local Hugging Face model directory
    HUB = "hub"  # anything else: a hub id


def path_kind(path) -> PathKind:
    """What `path` names (not checked further: `checkpoint` says what is wrong with it)."""
    from ..backends.head import is_head

    local = Path(path).expanduser()
    if _names_gguf(local):
        return PathKind.GGUF
    if local.is_dir():
        return PathKind.HEAD if is_head(local) else PathKind.DIRECTORY
    return PathKind.HUB


def checkpoint(path) -> str | Path:
    """The model directory behind `path`: a GGUF file (or a directory holding one and no
    config.json) is converted once into a cached directory; a local directory is checked; any
    other string is a hub id, returned as given."""
    from ..backends import hf

    if isinstance(path, (str, os.PathLike)) and _names_gguf(Path(path).expanduser()):
        from . import gguf

        return gguf.convert(Path(path).expanduser())
    return hf.resolve_path(path)


def _names_gguf(local: Path) -> bool:
    from . import gguf

    holds_gguf = local.is_dir() and not (local / "config.json").exists() and any(local.glob("*.gguf"))
    return local.suffix == ".gguf" or gguf.is_gguf(local) or holds_gguf
