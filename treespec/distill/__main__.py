"""`python -m treespec.distill --target T --out DIR ...` (the same as `treespec distill`)."""

import argparse

from .cli import add_arguments, run

parser = argparse.ArgumentParser(
    prog="python -m treespec.distill", description="Distill a draft model for a target."
)
add_arguments(parser)
try:
    run(parser.parse_args())
except ValueError as e:
    parser.error(str(e))
