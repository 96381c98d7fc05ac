"""`python -m treespec ...` (and `torchrun ... -m treespec ...`): the `treespec` command."""

from .cli import console

console()
