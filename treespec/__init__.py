"""treespec: lossless tree-based multi-draft speculative decoding.

from treespec import SpeculativeDecoder, TreeConfig, SamplingConfig
dec = SpeculativeDecoder.from_pretrained(target="...", draft="...")
out = dec.generate("def quicksort(xs):", max_new_tokens=128,
                   tree=TreeConfig(width=4, depth=6),
                   sampling=SamplingConfig(temperature=0.8, top_p=0.95), seed=0)
out.text, out.token_ids, out.stats.tokens_per_step, out.stats.acceptance_by_depth
"""

import importlib
import sys
import types
from typing import TYPE_CHECKING

# Where each public name lives. Importing treespec is cheap (the `treespec` command starts, and
# answers Ctrl-C, before torch loads); a name's module is imported on first use.
_EXPORTS = {
    "Runner": ".backends",
    "HFRunner": ".backends.hf",
    "SamplingConfig": ".config",
    "TreeConfig": ".config",
    "SpeculativeDecoder": ".decoder",
    "BigramDrafter": ".drafters",
    "Drafter": ".drafters",
    "MergedDrafter": ".drafters",
    "ModelDrafter": ".drafters",
    "NgramDrafter": ".drafters",
    "PromptLookupDrafter": ".drafters",
    "UnigramDrafter": ".drafters",
    "Engine": ".engine",
    "GenerationOutput": ".output",
    "TokenLogprobs": ".output",
    "DraftTree": ".proposal",
    "Draw": ".proposal",
    "ProposalGroup": ".proposal",
    "Walk": ".proposal",
    "Request": ".request",
    "Rng": ".rng",
    "TorchRng": ".rng",
    "GenerationStats": ".stats",
    "TokenTree": ".tree",
    "verify": ".verify",
}


class _Package(types.ModuleType):
    """`treespec.verify` is the function, as `from treespec import verify` promises: importing
    the submodule of the same name does not replace it (the module stays in sys.modules)."""

    def __setattr__(self, name: str, value) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'treespec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from .backends import Runner
    from .backends.hf import HFRunner
    from .config import SamplingConfig, TreeConfig
    from .decoder import SpeculativeDecoder
    from .drafters import (
        BigramDrafter,
        Drafter,
        MergedDrafter,
        ModelDrafter,
        NgramDrafter,
        PromptLookupDrafter,
        UnigramDrafter,
    )
    from .engine import Engine
    from .output import GenerationOutput, TokenLogprobs
    from .proposal import DraftTree, Draw, ProposalGroup, Walk
    from .request import Request
    from .rng import Rng, TorchRng
    from .stats import GenerationStats
    from .tree import TokenTree
    from .verify import verify

__all__ = [
    "BigramDrafter",
    "DraftTree",
    "Draw",
    "Drafter",
    "Engine",
    "GenerationOutput",
    "GenerationStats",
    "HFRunner",
    "MergedDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "PromptLookupDrafter",
    "ProposalGroup",
    "Request",
    "Rng",
    "Runner",
    "SamplingConfig",
    "SpeculativeDecoder",
    "TokenLogprobs",
    "TokenTree",
    "TorchRng",
    "TreeConfig",
    "UnigramDrafter",
    "Walk",
    "verify",
]
__version__ = "0.1.0"
