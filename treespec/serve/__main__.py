"""`python -m treespec.serve [flags]`: the same as `treespec serve [flags]`."""

from __future__ import annotations

import argparse
import sys

from .cli import add_arguments, run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="treespec serve", description="An OpenAI-compatible server with lossless tree speculation."
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
