"""Draft samplers: anything that proposes a token tree for the target to verify."""

from .base import Drafter
from .model import ModelDrafter

__all__ = ["Drafter", "ModelDrafter"]
