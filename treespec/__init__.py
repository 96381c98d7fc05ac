"""treespec: lossless tree-based multi-draft speculative decoding.

from treespec import SpeculativeDecoder, TreeConfig, SamplingConfig
dec = SpeculativeDecoder.from_pretrained(target="...", draft="...")
out = dec.generate("def quicksort(xs):", max_new_tokens=128,
                   tree=TreeConfig(width=4, depth=6),
                   sampling=SamplingConfig(temperature=0.8, top_p=0.95), seed=0)
out.text, out.token_ids, out.stats.tokens_per_step, out.stats.acceptance_by_depth
"""

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
from .output import GenerationOutput
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
    "TokenTree",
    "TorchRng",
    "TreeConfig",
    "UnigramDrafter",
    "Walk",
    "verify",
]
__version__ = "0.1.0"
