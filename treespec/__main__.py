"""`python -m treespec ...` (and `torchrun ... -m treespec ...`): the `treespec` command."""

import sys

from .cli import main

sys.exit(main())
