"""Draft samplers: anything that proposes a token tree for the target to verify.

Each drafter kind (`DrafterFactory`, `config.DRAFTER_KINDS`) and what makes it:

    "model"    ModelDrafter                 a draft model's `Runner`, level by level
    "head"     HeadDrafter (drafters.head)  a feature head (EAGLE-3) that reads the target: a
                                            `backends.head.HeadRunner` running the weights that
                                            `distill.head_model.HeadModel` trains
    "ngram"    NgramDrafter                 n-gram tables over the sequence
    "lookup"   PromptLookupDrafter          continuations of earlier matches in the context
    "merged"   MergedDrafter                a draft model's tree and the n-gram tree in one

`FeatureDrafter` is the deprecated former name of `HeadDrafter`.
"""

from .base import Drafter, DraftForward, check_draft, draft_tree, propose_many
from .counts import BigramDrafter, CountDrafter, UnigramDrafter
from .factory import DRAFTER_KINDS, DrafterFactory
from .head import FeatureDrafter, HeadDrafter
from .merged import MergedDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter, PromptLookupDrafter

__all__ = [
    "DRAFTER_KINDS",
    "BigramDrafter",
    "CountDrafter",
    "DraftForward",
    "Drafter",
    "DrafterFactory",
    "FeatureDrafter",
    "HeadDrafter",
    "MergedDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "PromptLookupDrafter",
    "UnigramDrafter",
    "check_draft",
    "draft_tree",
    "propose_many",
]
