"""Which verification rule a request runs: the one owner of that decision.

Three names describe how proposals come about, each for its own concept:

    Strategy   (`TreeConfig.strategy`, treespec.config) the recipe a user picks for the tree's
               shape: "iid", "without_replacement", "topk", "dynamic", "sequoia" or "auto"
    Draw       (`ProposalGroup.draw`, treespec.proposal) how ONE group of sibling proposals was
               drawn: i.i.d. from q, without replacement from q, or deterministic (q one-hot)
    Siblings   (here) what a whole round's tree guarantees about its siblings, from the
               strategy and the drafter kind, before any tree is drawn: the key of the table
               of rules that are lossless on it (`rules_for`)

The rules themselves (`Rule`) are walks of `treespec.verify`; docs/verification.md says why each
one applies where it does. Every front end checks a user's `verification=` with `rule_name`;
the engine asks `choose_rule(siblings_of(...), verification)` once per request; `check_rule`
checks a round's tree where nothing was known in advance (a user's `Drafter`).
"""

from __future__ import annotations

from enum import Enum

from .config import SHAPED_DRAFTERS, TreeConfig
from .proposal import DraftTree, Draw


class Rule(str, Enum):
    """A verification rule: a walk of `treespec.verify`."""

    TOKEN = "token"  # proposal by proposal from the root (SpecInfer; any tree)
    BLOCK = "block"  # whole paths of a chain (Sun et al. 2025)
    TRAVERSAL = "traversal"  # whole paths of a tree of distinct siblings (Weng et al. 2025)


RULES: tuple[str, ...] = tuple(r.value for r in Rule)
AUTO = "auto"  # `verification="auto"` (or None): the best rule that applies (`choose_rule`)


class Siblings(str, Enum):
    """How a round's sibling proposals are drawn, as far as the rules care."""

    CHAIN = "chain"  # no siblings: one proposal per node (width 1)
    DISTINCT = "distinct"  # distinct children drawn without replacement or deterministic
    IID = "iid"  # drawn independently from q (duplicates merged into one node)
    MERGED = "merged"  # several drafters' proposals share nodes (MergedDrafter)
    CUSTOM = "custom"  # a user's Drafter: unknown until its trees are seen, so each round is checked


# The rules that are lossless for each way of drawing siblings, worst to best; the last is the
# default, except for custom drafters ("token").
_RULES_FOR: dict[Siblings, tuple[str, ...]] = {
    Siblings.CHAIN: ("token", "traversal", "block"),  # equal in law on a chain; block accepts the most
    Siblings.DISTINCT: ("token", "traversal"),
    Siblings.IID: ("token",),
    Siblings.MERGED: ("token",),
    Siblings.CUSTOM: RULES,
}


def rule_name(verification: str | None) -> str | None:
    """A verification setting checked once for every front end: a rule of `RULES`, or None for
    "auto" / None (the best that applies); ValueError naming the choices otherwise."""
    if verification is None or verification == AUTO:
        return None
    if verification not in RULES:
        raise ValueError(
            f"verification must be one of {', '.join(RULES)} or 'auto' (the best that applies), "
            f"got {verification!r}"
        )
    return verification


def rules_for(siblings: str) -> tuple[str, ...]:
    """The rules that are lossless on trees whose siblings are drawn as `siblings`, worst to best."""
    return _RULES_FOR[Siblings(siblings)]


def rule_fits(siblings: str, verification: str | None) -> bool:
    """Whether a tree whose siblings are drawn as `siblings` can run `verification` (None or
    "auto": the best that applies, which always can)."""
    verification = rule_name(verification)
    return verification is None or verification in rules_for(siblings)


def choose_rule(siblings: str, verification: str | None) -> str:
    """The rule a request runs: `verification`, or the best that applies when None or "auto"."""
    siblings = Siblings(siblings)
    fits = rules_for(siblings)
    if rule_name(verification) is None:
        return Rule.TOKEN.value if siblings is Siblings.CUSTOM else fits[-1]
    if not rule_fits(siblings, verification):
        raise ValueError(
            f"verification={verification!r} does not apply to a tree whose siblings are "
            f"{siblings.value}: block needs a "
            f"chain (width 1), traversal needs siblings drawn without replacement or deterministically (not "
            "strategy 'iid' with width > 1, not drafter 'merged'); here "
            f"{' or '.join(map(repr, fits))} applies"
        )
    return verification


def siblings_of(tree: TreeConfig | None, drafter: str, verification: str | None = None) -> Siblings:
    """How the trees that drafter kind `drafter` (a name of `config.DRAFTER_KINDS`, or "custom"
    for a user's `Drafter`) drafts for `tree` draw siblings. No tree (plain decoding) verifies
    no draft: every rule is the same there, and "custom" lets the cheapest run. An automatic
    tree is planned when its request is admitted: a Sequoia shape (distinct siblings) for
    drafters that follow shapes, a chain for the others and where `verification` is "block"."""
    if tree is None or drafter == "custom":
        return Siblings.CUSTOM
    if drafter == "merged":
        return Siblings.MERGED
    if tree.auto:
        if drafter in SHAPED_DRAFTERS and verification != Rule.BLOCK.value:
            return Siblings.DISTINCT
        tree = TreeConfig(width=1, depth=1)
    if drafter in ("ngram", "lookup"):  # deterministic proposals
        return Siblings.CHAIN if tree.width == 1 else Siblings.DISTINCT
    if tree.strategy == "sequoia":
        chain = all(len(c) <= 1 for c in tree.shape.children())
    else:
        chain = tree.width == 1
    return Siblings.CHAIN if chain else Siblings.IID if tree.strategy == "iid" else Siblings.DISTINCT


def check_rule(draft: DraftTree, rule: str) -> None:
    """The structure `rule` needs, checked on this round's tree (ValueError if missing)."""
    if rule_name(rule) is None:
        raise ValueError(f"verify() runs one rule of {', '.join(RULES)}, got {rule!r}")
    tree = draft.tree
    if rule == Rule.BLOCK and any(
        sum(len(g.tokens) for g in draft.groups_at(u)) > 1 for u in range(len(tree))
    ):
        raise ValueError(
            "block verification needs a chain with one proposal per node (width 1); this draft is a tree: "
            "use 'traversal' (siblings drawn without replacement or deterministic) or 'token'"
        )
    if rule == Rule.TRAVERSAL:
        for u in range(len(tree)):
            groups = draft.groups_at(u)
            kids = [c for g in groups for c in g.children]
            if len(kids) > 1 and (
                len(set(kids)) < len(kids) or any(g.draw is Draw.IID and len(g.tokens) > 1 for g in groups)
            ):
                raise ValueError(
                    "traversal verification needs siblings drawn without replacement or "
                    "deterministic, each with its "
                    "own subtree; this tree has i.i.d. or merged siblings: use 'token' (or 'block' "
                    "on a chain)"
                )
