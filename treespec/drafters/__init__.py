"""Draft samplers: anything that proposes a token tree for the target to verify."""

from .base import Drafter, DraftForward, check_draft, draft_tree, propose_many
from .counts import BigramDrafter, CountDrafter, UnigramDrafter
from .factory import DRAFTER_KINDS, DrafterFactory
from .head import FeatureDrafter
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
    "MergedDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "PromptLookupDrafter",
    "UnigramDrafter",
    "check_draft",
    "draft_tree",
    "propose_many",
]
