"""Which drafter each request gets, and how its trees draw siblings.

A decoder names one drafter kind for all its requests ("model", "ngram", "lookup",
"merged") or hands over one `Drafter` instance. The engine asks the factory for each
request's drafter when the request is admitted (a named kind gets a fresh drafter over the
request's lane of the draft model), and the request's verification rule is chosen from how
that drafter draws siblings (`siblings`, decided by `treespec.rules`).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..backends.base import Runner
from ..config import DRAFTER_KINDS, SHAPED_DRAFTERS, TreeConfig
from ..rules import Siblings, siblings_of
from .base import Drafter
from .head import HeadDrafter
from .merged import MergedDrafter
from .model import ModelDrafter
from .ngram import NgramDrafter, PromptLookupDrafter


class DrafterFactory:
    """Makes each request's drafter. `kind`: a name in `DRAFTER_KINDS`, or a `Drafter` used as
    it is (it holds one sequence's state, so it serves one request at a time). `vocab_size`:
    the length of q (the target's rows); `support`: q puts mass only on ids below it."""

    def __init__(
        self,
        kind: str | Drafter = "model",
        vocab_size: int | None = None,
        support: int | None = None,
        options: Mapping[str, int] | None = None,
    ):
        """`options`: settings of a model-free kind's drafters, as their constructors name them
        ("lookup": `PromptLookupDrafter`'s min_ngram, max_ngram; "ngram": `NgramDrafter`'s
        window); the width always comes from the request's tree."""
        if not isinstance(kind, Drafter) and kind not in DRAFTER_KINDS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTER_KINDS)} or a Drafter, got {kind!r}")
        if options and kind not in ("ngram", "lookup"):
            raise ValueError(f"drafter options are for the 'ngram' and 'lookup' kinds, not {kind!r}")
        self.kind, self.vocab_size, self.support = kind, vocab_size, support
        self.options = dict(options or {})

    @property
    def custom(self) -> bool:
        """A user's `Drafter`: its trees are checked every round (nothing is known in advance)."""
        return isinstance(self.kind, Drafter)

    @property
    def follows_shapes(self) -> bool:
        """Whether its drafters draft along any tree shape (a draft model's, a head's); the
        others propose chains of their own making, so an automatic tree plans a chain for them."""
        return self.kind in SHAPED_DRAFTERS

    @property
    def needs_draft_model(self) -> bool:
        return self.kind in ("model", "head", "merged")

    def taps(self, draft: Runner | None) -> tuple[int, ...]:
        """The target layers this factory's drafters read (a feature head's; () for the rest)."""
        if self.custom:
            return tuple(self.kind.taps)
        if self.kind == "head":
            if draft is None or not draft.takes_hidden:
                raise ValueError(
                    "drafter='head' needs a feature head as the draft (an EAGLE-3 checkpoint, "
                    "`treespec.backends.head.HeadRunner`)"
                )
            return tuple(draft.target_taps)
        return ()

    def reusable(self, draft: Runner | None, prompt) -> int | None:
        """How many leading positions of `prompt` the target may keep from its cache (prefix
        reuse) for this factory's drafters; None: as many as it shares. A feature head holds
        the target's features only for its own kept slots (slot t: position t, read with token
        t + 1), so the target keeps no more positions than those, and recomputes the rest with
        their features; a custom drafter that reads features keeps none."""
        if not self.taps(draft):
            return None
        if self.custom or not draft.prefix_reuse:
            return 0
        kept = 0
        for a, b in zip(draft.committed, prompt[1:]):
            if a != int(b):
                break
            kept += 1
        return kept

    @property
    def name(self) -> str:
        return type(self.kind).__name__ if self.custom else repr(self.kind)

    @property
    def kind_name(self) -> str:
        """Its kind as `treespec.rules.siblings_of` reads it: a name of `DRAFTER_KINDS`, or
        "custom" for a user's `Drafter`."""
        return "custom" if self.custom else self.kind

    def siblings(self, tree: TreeConfig | None, verification: str | None = None) -> Siblings:
        """How the drafter's trees for `tree` draw siblings (`treespec.rules.siblings_of`)."""
        return siblings_of(tree, self.kind_name, verification)

    def make(self, tree: TreeConfig, draft: Runner | None) -> Drafter:
        """The drafter of one request, drafting with `draft` (its lane of the draft model)."""
        if self.custom:
            return self.kind
        if self.kind == "ngram":
            return NgramDrafter(tree.width, **self.options)
        if self.kind == "lookup":
            return PromptLookupDrafter(tree.width, **self.options)
        if self.kind == "head":
            return HeadDrafter(draft, tree, vocab_size=self.vocab_size)
        model = ModelDrafter(draft, tree, vocab_size=self.vocab_size, support=self.support)
        return model if self.kind == "model" else MergedDrafter([model, NgramDrafter(tree.width)])
