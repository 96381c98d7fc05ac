"""Draft samplers: anything that proposes a token tree for the target to verify."""

from .base import Drafter
from .counts import BigramDrafter, CountDrafter, UnigramDrafter
from .merged import MergedDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter, PromptLookupDrafter

__all__ = ["BigramDrafter", "CountDrafter", "Drafter", "MergedDrafter", "ModelDrafter", "NgramDrafter", "PromptLookupDrafter", "UnigramDrafter"]
