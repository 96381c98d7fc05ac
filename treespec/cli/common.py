"""What every subcommand shares: the user error (`CliError`), the configs its flags describe,
the models they name, whether to colour, and checking an output path before a long run."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from ..config import SamplingConfig, TreeConfig


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def configs(args) -> tuple[TreeConfig, SamplingConfig]:
    """The tree and sampling configs of the speculation and sampling flags."""
    try:
        shape, strategy, depth = None, args.strategy, args.depth
        if args.shape is not None:
            from ..sequoia import TreeShape

            shape = TreeShape.load(args.shape)
            strategy, depth = "sequoia", max(1, shape.depth)
        tree = TreeConfig(
            width=args.width,
            depth=depth,
            strategy=strategy,
            budget=args.budget,
            adaptive=args.adaptive,
            plain_fallback=args.plain_fallback,
            depth_max=args.depth_max,
            shape=shape,
        )
        sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as e:
        raise CliError(str(e).replace("TreeConfig.", "--")) from e
    return tree, sampling


def model_paths(args) -> tuple:
    """(target, draft) from --pair / --target / --draft."""
    from ..options import model_paths as paths_of

    try:
        return paths_of(args, getattr(args, "plain", False))
    except ValueError as e:
        raise CliError(str(e)) from None


def load(args):
    """The decoder the model flags describe."""
    from ..options import load_decoder

    model_paths(args)  # flags that do not go together fail as a CLI error
    return load_decoder(args, getattr(args, "plain", False))


def use_colour(choice: str = "auto", stream=None) -> bool:
    """Colour codes only where a person reads them: a terminal, and NO_COLOR unset
    (https://no-color.org); "always"/"never" override both."""
    if choice != "auto":
        return choice == "always"
    stream = sys.stdout if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)()) and not os.environ.get("NO_COLOR")


def check_writable(path: Path, flag: str) -> None:
    """Fail before a long run, not after it, if `path` cannot be written."""
    if path.is_dir():
        raise CliError(f"{flag} {path} is a directory; give a file name")
    parent = path.resolve().parent
    if not parent.is_dir():
        raise CliError(f"{flag} {path}: directory {parent} does not exist")
    try:
        if path.exists():
            with open(path, "a"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=parent, prefix=".treespec-write-test-"):
                pass
    except OSError as e:
        raise CliError(f"{flag} {path} is not writable ({e.strerror or e}); choose another path") from None
