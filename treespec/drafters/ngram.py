"""Model-free drafters: n-gram statistics and prompt lookup over the sequence itself.

Both propose deterministic tokens (q one-hot), so they are lossless at any temperature and
cost no draft forward. When nothing matches they propose an empty tree, and the round is one
plain target step. Under a constraint each path stops before the first token its grammar
forbids (`Drafter.allowed_paths`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ..config import SamplingConfig
from ..proposal import DraftTree
from ..rng import Rng
from .base import Drafter


class NgramDrafter(Drafter):
    """Hashed n-gram tables over a sliding window of the committed tokens.

    For every order n in `orders` the table maps a hash of n-1 context tokens to the counts of
    the token that followed them. It is seeded from the prompt and updated with every committed
    token; n-grams that start before the window are evicted. Prediction uses the longest order
    whose context has been seen, and chains its own predictions. The tree is a beam over those
    predictions: each path branches on its `width` most frequent continuations and the `width`
    paths with the highest product of relative frequencies survive each depth (one path: a chain).
    """

    def __init__(
        self, width: int = 1, orders: Sequence[int] = (2, 3, 4), window: int = 512, n_buckets: int = 1 << 20
    ):
        if width < 1 or window < 2 or not orders or min(orders) < 2:
            raise ValueError("NgramDrafter needs width >= 1, window >= 2 and orders >= 2")
        if n_buckets & (n_buckets - 1):
            raise ValueError("n_buckets must be a power of two")
        self.width, self.window, self.n_buckets = width, window, n_buckets
        self.orders = tuple(sorted(set(orders), reverse=True))  # longest context first
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []  # every token seen, in order
        self.lo = 0  # index of the first token inside the window
        self.tables: dict[int, dict[int, Counter]] = {n: {} for n in self.orders}

    def _bucket(self, context: Sequence[int]) -> int:
        return hash(tuple(context)) & (self.n_buckets - 1)  # int tuples hash deterministically

    def _count(self, start: int, n: int, delta: int) -> None:
        """Add `delta` to the n-gram tokens[start : start + n]."""
        table = self.tables[n]
        key = self._bucket(self.tokens[start : start + n - 1])
        nxt = self.tokens[start + n - 1]
        counts = table.setdefault(key, Counter())
        counts[nxt] += delta
        if counts[nxt] <= 0:
            del counts[nxt]
            if not counts:
                del table[key]

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens: count the n-grams they end, evict those leaving the window."""
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            for n in self.orders:
                if end - n >= self.lo:
                    self._count(end - n, n, +1)
            while end - self.lo > self.window:  # n-grams starting at lo leave the window
                for n in self.orders:
                    if self.lo + n <= end:
                        self._count(self.lo, n, -1)
                self.lo += 1

    def predict(self, context: Sequence[int]) -> list[tuple[int, float]]:
        """(token, relative frequency) after `context`, from the longest matching order."""
        for n in self.orders:
            if len(context) >= n - 1:
                counts = self.tables[n].get(self._bucket(context[len(context) - n + 1 :]))
                if counts:
                    total = sum(counts.values())
                    ranked = sorted(counts.items(), key=lambda kv: -kv[1])  # stable: first seen wins ties
                    return [(t, c / total) for t, c in ranked]
        return []

    # ---- Drafter ---------------------------------------------------------------------------
    def start(self, prompt: Sequence[int], sampling: SamplingConfig, rng: Rng) -> None:
        self.reset()
        self.extend(prompt)

    def propose(self, context: Sequence[int], depth: int) -> DraftTree:
        if list(context[: len(self.tokens)]) != self.tokens:
            raise RuntimeError("n-gram history is out of sync with the committed tokens")
        self.extend(context[len(self.tokens) :])
        beams: list[tuple[float, list[int]]] = [(1.0, [])]
        done: list[tuple[float, list[int]]] = []
        for _ in range(depth):
            cands = []
            for score, path in beams:
                preds = self.predict(list(context) + path)[: self.width]
                if not preds:
                    done.append((score, path))
                cands += [(score * f, path + [t]) for t, f in preds]
            beams = sorted(cands, key=lambda c: -c[0])[: self.width]
            if not beams:
                break
        paths = [p for _, p in sorted(beams + done, key=lambda c: -c[0]) if p]
        return DraftTree.from_paths(context[-1], self.allowed_paths(paths))


class PromptLookupDrafter(Drafter):
    """Prompt lookup: find the last n tokens earlier in the context, propose what followed.

    The longest n in [min_ngram, max_ngram] with a match wins; its `width` most recent matches
    with distinct continuations become the branches of the tree.
    """

    def __init__(self, width: int = 1, max_ngram: int = 3, min_ngram: int = 1):
        if width < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError("PromptLookupDrafter needs width >= 1 and 1 <= min_ngram <= max_ngram")
        self.width, self.max_ngram, self.min_ngram = width, max_ngram, min_ngram

    def start(self, prompt: Sequence[int], sampling: SamplingConfig, rng: Rng) -> None:
        pass

    def lookup(self, context: Sequence[int], depth: int) -> list[list[int]]:
        ctx = list(context)
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            pattern, paths = ctx[-n:], []
            for j in range(len(ctx) - n - 1, -1, -1):  # most recent first; j + n < len(ctx)
                if ctx[j : j + n] == pattern:
                    cont = ctx[j + n : j + n + depth]
                    if cont not in paths:
                        paths.append(cont)
                        if len(paths) == self.width:
                            break
            if paths:
                return paths
        return []

    def propose(self, context: Sequence[int], depth: int) -> DraftTree:
        return DraftTree.from_paths(context[-1], self.allowed_paths(self.lookup(context, depth)))
