"""`treespec distill`: train a draft model for any target, ready for speculative decoding.

from treespec.distill import distill
distill("path/to/target", "my_draft", minutes=30)          # -> a HF draft directory
SpeculativeDecoder.from_pretrained(target="path/to/target", draft="my_draft")

recipe.py    every knob (`Recipe`), checked before any work
prompts.py   prompt files and the bundled prompt sets, rendered for the target
data.py      the target's responses and top-k distributions, stored in shards
model.py     the draft's shape, its initialisation from the target, save and load
subset.py    subset-vocabulary drafts and the runner that keeps them lossless
losses.py    KL / TV / JSD on the stored top-k buckets
train.py     the deterministic, budgeted, resumable training loop
evaluate.py  held-out acceptance through treespec, the 1 - TV proxy, the plot
pipeline.py  `distill()`: the phases in order, resumable
cli.py       `treespec distill` / `python -m treespec.distill`
"""

from ..backends.subset import SubsetVocabRunner, VocabMap
from .model import load_draft, load_draft_runner
from .pipeline import distill
from .recipe import Recipe

__all__ = ["Recipe", "SubsetVocabRunner", "VocabMap", "distill", "load_draft", "load_draft_runner"]
