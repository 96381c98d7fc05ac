"""Draft samplers: anything that proposes a token tree for the target to verify."""

from .base import DraftForward, Drafter, propose_many
from .counts import BigramDrafter, CountDrafter, UnigramDrafter
from .merged import MergedDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter, PromptLookupDrafter

__all__ = ["BigramDrafter", "CountDrafter", "DraftForward", "Drafter", "MergedDrafter", "ModelDrafter", "NgramDrafter", "PromptLookupDrafter", "UnigramDrafter", "propose_many"]
