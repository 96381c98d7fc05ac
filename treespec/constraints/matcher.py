"""One request's grammar state over a token tree.

The constrained target at a node is the target masked to the tokens the grammar allows after
the committed output plus the node's own path, renormalised: `TreeMatcher.mask_logits` sets the
other tokens' logits to -inf before the sampling transforms (so top-k / top-p choose among the
allowed tokens and temperature 0 takes the best allowed one). Drafters mask their logits the
same way, so q is exactly what a proposal was drawn from and a forbidden token is never
proposed. The mask at a path is a function of the path alone: the matcher advances along it,
reads the mask and rolls back (llguidance keeps the committed state); masks are cached for the
round and dropped when the round's tokens are committed.

Where the grammar allows one token, the constrained target gives it probability 1; where it
forces a string that more than one spelling of tokens can write (`, "age": `), the grammar's
tokenizer's spelling of it is what the target nearly always picks.
`extend_forced` appends both below the tree's leaves as deterministic proposals, which the
target scores in the same forward: every rule accepts a forced token with probability 1 and a
forced string's token with its constrained probability, as any deterministic draft.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..proposal import DraftTree, Draw, ProposalGroup, Walk
from ..tree import TokenTree
from .grammar import GrammarVocabulary
from .spec import Constraint

Path = tuple[int, ...]
FORCED_EXTRA = 16  # forced tokens may extend a tree this far below its configured depth
# an automatic tree whose plan expects less than this speedup over plain decoding does not draft
# with its drafter for a constrained request, which drafts by prompt lookup instead (below): on
# JSON-schema extraction with the default pair on a 2-core Zen 4 (experiments/structured/speed.py,
# T=0), forced tokens alone gave 1.33-1.35x constrained plain decoding, and a chain of 1 planned
# at 1.22x plus forced tokens 1.20x
DRAFTER_MIN_SPEEDUP = 1.4
# there, a constrained request drafts a chain of this many tokens by prompt lookup, cut by its
# grammar (no draft forward), below which its forced tokens follow
# (experiments/structured/lookup_variants.py --repeats 4, compiled, over constrained plain
# decoding, T=0): extraction 1.51-1.62x against 1.31x for forced tokens alone (chains of 2, 3
# and 8: 1.53-1.57x, 1.50-1.61x, 1.42-1.45x over two runs), JSON stories, which copy little,
# 1.12-1.15x against 1.05-1.08x
LOOKUP_DEPTH = 4
# the shortest match a lookup chain starts from, per temperature class: sampled, chains from
# 1-token matches lost on the stories (0.88x against 1.06x for forced tokens alone), chains from
# 2-token matches gained on extraction (1.43x against 1.31x, 12 repeats) and decoded the stories
# as fast as forced tokens alone (220.2 against 218.8 tok/s)
LOOKUP_MIN_MATCH = {"T0": 1, "T1": 2}


class TreeMatcher:
    """The grammar state of one request: committed tokens, masks at any path below them."""

    def __init__(self, vocab: GrammarVocabulary, constraint: Constraint):
        self.vocab, self.constraint = vocab, constraint
        self._matcher = vocab.matcher(constraint)
        self._masks: dict[Path, tuple[torch.Tensor, int | None]] = {}  # `_read`'s, this round
        self._strings: dict[Path, list[int]] = {}
        self._ended = False

    def allowed(self, path: Sequence[int] = ()) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows after the committed tokens + `path`. A path
        the grammar cannot take gets every token (its node is never reached: its own token has
        probability 0 under the constrained target)."""
        return self._read(tuple(path))[0]

    def forced(self, path: Sequence[int] = ()) -> int | None:
        """The one token the grammar allows after `path`, or None."""
        return self._read(tuple(path))[1]

    def _read(self, path: Path) -> tuple[torch.Tensor, int | None]:
        """`allowed` and `forced` after `path`, read once a round."""
        hit = self._masks.get(path)
        if hit is not None:
            return hit
        m, eos = self._matcher, list(self.vocab.eos)
        n = m.try_consume_tokens(list(path)) if path else 0
        if n == len(path) and not m.is_error():
            bitmask = m.compute_bitmask()
            mask, one = self.vocab.unpack(bitmask), self.vocab.single(bitmask)
            # numpy's any: torch's takes 25 us on a row of 49,152, numpy's 2
            if one is None and not mask.numpy().any():  # nothing may follow (a stopped grammar): only the end
                mask[eos] = True
                one = eos[0] if len(eos) == 1 else None
        elif m.is_stopped() and not m.is_error() and all(t in self.vocab.eos for t in path[n:]):
            mask = torch.zeros(self.vocab.size, dtype=torch.bool)  # past the end (ignore_eos): the end
            mask[eos] = True
            one = eos[0] if len(eos) == 1 else None
        else:
            mask, one = torch.ones(self.vocab.size, dtype=torch.bool), None
        if n:
            m.rollback(n)
        self._masks[path] = mask, one
        return mask, one

    def masks(self, paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """[n, V] bool: `allowed` of each path (one path: a view of its mask, not a copy)."""
        if len(paths) == 1:
            return self.allowed(paths[0])[None]
        return torch.stack([self.allowed(p) for p in paths])

    def mask_logits(
        self, logits: torch.Tensor, paths: Sequence[Sequence[int]], draft: bool = False
    ) -> torch.Tensor:
        """[n, V'] logits with the tokens the grammar forbids after each path at -inf (rows
        wider than the vocabulary: the extra ids forbidden too). `draft=True`: a row that puts
        no mass on any allowed token (a draft whose vocabulary lacks them) becomes uniform over
        the allowed tokens, a distribution like any other to draw from."""
        allowed = self.masks(paths).to(logits.device)
        V = logits.shape[-1]
        if allowed.shape[-1] < V:
            allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[-1]))
        allowed = allowed[:, :V]
        out = torch.where(allowed, logits, float("-inf"))  # a third faster than masked_fill(~allowed)
        if draft:
            empty = ~torch.isfinite(out.amax(-1, keepdim=True))  # [n, 1]
            out = torch.where(empty & allowed, torch.zeros_like(out), out)
        return out

    def taken(self, path: Sequence[int]) -> int:
        """How many tokens of `path` (below the committed ones) the grammar takes in a row."""
        n = self._matcher.try_consume_tokens(list(path)) if path else 0
        if n:
            self._matcher.rollback(n)
        return n

    def forced_string(self, path: Sequence[int] = ()) -> list[int]:
        """The tokenizer's spelling of the string the grammar forces after `path` (its
        fast-forward bytes), as far as the grammar takes it; [] when it forces none, or the
        path leaves the grammar."""
        path = tuple(path)
        hit = self._strings.get(path)
        if hit is not None:
            return hit
        m, out = self._matcher, []
        n = m.try_consume_tokens(list(path)) if path else 0
        if n == len(path) and not m.is_error():
            spelling = self.vocab.tokenizer.tokenize_bytes(m.compute_ff_bytes())
            k = m.try_consume_tokens(spelling) if spelling else 0  # the part the grammar takes
            out = spelling[:k]
            n += k
        if n:
            m.rollback(n)
        self._strings[path] = out
        return out

    def extend_forced(self, draft: DraftTree, room: int) -> DraftTree:
        """`draft` with each leaf extended (at most `room` below the root) by the token the
        grammar allows alone after it, or else by the grammar's spelling of the string it
        forces, again and again: deterministic single-child proposals, the first kind accepted
        with probability 1 by the constrained target. The original nodes keep their indices."""
        tree = draft.tree
        tokens, parents, groups = list(tree.tokens), list(tree.parents), list(draft.groups)
        for leaf in [u for u in range(len(tree)) if tree.is_leaf(u)]:
            path = [tree.tokens[n] for n in tree.path_to(leaf)[1:]]
            node = leaf
            while len(path) < room:
                x = self.forced(path)
                run = [x] if x is not None else self.forced_string(path)[: room - len(path)]
                if not run:
                    break
                for x in run:
                    tokens.append(x)
                    parents.append(node)
                    groups.append(ProposalGroup(node, Draw.DETERMINISTIC, (x,), (len(tokens) - 1,)))
                    node = len(tokens) - 1
                    path.append(x)
        if len(tokens) == len(tree):
            return draft
        return DraftTree(TokenTree(tokens, parents), tuple(groups))

    def paths(self, tree: TokenTree) -> list[Path]:
        """Every node's tokens below the root, in node order."""
        out: list[Path] = [()]
        for u in range(1, len(tree)):
            out.append(out[tree.parents[u]] + (tree.tokens[u],))
        return out

    def count_forced(self, tree: TokenTree, path: Sequence[int], emitted: Sequence[int]) -> tuple[int, int]:
        """Of the tokens `emitted` after the walk's `path` (node indices, root first): how many
        the grammar forced (allowed alone), and how many of those were accepted draft tokens."""
        paths = self.paths(tree)
        forced = accepted = 0
        for i in range(min(len(emitted), len(path))):  # token i follows node path[i]
            if self.forced(paths[path[i]]) is not None:
                forced += 1
                accepted += i + 1 < len(path)
        return forced, accepted

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance the committed state by a round's emitted tokens; drop the round's masks.
        After the end of sequence the grammar takes nothing more (only the end may follow)."""
        self._masks.clear()
        self._strings.clear()
        for t in tokens:
            if self._ended:
                break
            if not self._matcher.consume_token(int(t)):
                raise ValueError(
                    f"the {self.constraint.describe()} rejected token {t}: {self._matcher.get_error()}"
                )
            self._ended = int(t) in self.vocab.eos and self._matcher.is_stopped()

    @property
    def finished(self) -> bool:
        """The grammar is complete and its end of sequence was emitted."""
        return self._ended


def drafted_walk(walk: Walk, own: DraftTree, extended: DraftTree) -> Walk:
    """`walk` (over `extended`, which is `own` with forced tokens appended below its leaves) as
    the drafter of `own` sees it: the path cut at the first forced node, whose token becomes
    the round's last token (a bonus token after `own`'s leaf). The drafter catches up on the
    rest from the committed tokens next round."""
    n = len(own.tree)
    k = next((i for i, u in enumerate(walk.path) if u >= n), None)
    if k is None:
        return walk
    return Walk(walk.path[:k], extended.tree.tokens[walk.path[k]], "bonus")
