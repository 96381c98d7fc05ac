"""Count-based draft models: unigram and bigram token frequencies (Leviathan et al., Table 3).

Each drafter turns counts into logits, `log(count + prior)`, and applies the round's
`SamplingConfig` with `treespec.sampling.probs`, exactly as the model drafter treats a draft
model's logits: temperature, top-k and top-p act on counts the way they act on logits, and
the q stored with every proposal is the very tensor its tokens were drawn from. So verification
is lossless whatever the counts are.

    unigram  q(x)        from log(count(x) + smoothing)
    bigram   q(x | prev) from log(count(prev, x) + smoothing * P_unigram(x))   (Dirichlet prior:
             rows with few counts fall back on the unigram distribution)

Trees: `width` sequences of `depth` tokens drawn i.i.d. (as `TreeConfig(strategy="iid")`),
merged into a prefix tree; the m sequences through a node are one i.i.d. proposal group of m
draws. At temperature 0 q is one-hot on the argmax, so every sequence is the same chain.

The bundled counts: `treespec/zoo/pycode/counts.npz` from the pycode pair's training corpus
(`experiments/build/build_count_drafters.py` rebuilds them), `treespec/zoo/smollm2/counts.npz` from
SmolLM2's own responses (`treespec distill` writes the counts of its data next to the draft).
`write_counts` makes a counts file from any token sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..config import SamplingConfig, check_positive_int
from ..proposal import DraftTree, Draw, ProposalGroup
from ..rng import Rng
from ..sampling import PenaltyContext, probs, tree_token_counts
from ..tree import TokenTree
from .base import Drafter

COUNTS_FILE = Path(__file__).resolve().parent.parent / "zoo" / "pycode" / "counts.npz"


def load_counts(path: str | Path | None = None) -> dict[str, np.ndarray]:
    """The arrays of a counts file (default: the bundled pycode counts)."""
    path = Path(path) if path is not None else COUNTS_FILE
    try:
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read token counts from {path}: {e}") from e


def write_counts(
    sequences, vocab: int, path: str | Path, min_bigram_count: int = 1, meta: dict | None = None
) -> dict:
    """Write the unigram counts [V] and the bigram counts (CSR: `bigram_indptr` [V + 1],
    `bigram_indices`, `bigram_counts`, rows = previous token) of `sequences` (each a sequence
    of token ids; no bigram spans two sequences) to `path`, in the format `load_counts` reads.
    Bigrams seen fewer than `min_bigram_count` times are dropped. Returns the corpus' sizes."""
    import json

    seqs = [np.asarray(s, dtype=np.int64) for s in sequences]
    stream = np.concatenate(seqs) if seqs else np.zeros(0, dtype=np.int64)
    unigram = np.bincount(stream, minlength=vocab).astype(np.int64)
    keys = np.concatenate([s[:-1] * vocab + s[1:] for s in seqs]) if seqs else stream
    pairs, counts = np.unique(keys, return_counts=True)
    keep = counts >= min_bigram_count
    pairs, counts = pairs[keep], counts[keep]
    rows = pairs // vocab  # sorted by (previous, next): CSR order
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=vocab))]).astype(np.int64)
    sizes = {"tokens": int(stream.size), "vocab_size": vocab, "distinct_bigrams_kept": int(pairs.size),
             "min_bigram_count": min_bigram_count}  # fmt: skip
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        path, unigram=unigram, bigram_indptr=indptr,
        bigram_indices=(pairs % vocab).astype(np.int16 if vocab <= 2**15 else np.int32),
        bigram_counts=counts.astype(np.int32), meta=np.array(json.dumps({**sizes, **(meta or {})})),
    )  # fmt: skip
    return sizes


class CountDrafter(Drafter):
    """Base class: i.i.d. sequences from a q that depends on the previous token at most.

    Subclasses implement `logits(prev)`, the [V] float64 logits after token `prev`.
    """

    def __init__(self, width: int = 1):
        check_positive_int("width", width)
        self.width = width
        self._q: dict[int, torch.Tensor] = {}

    def logits(self, prev: int) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def q(self, prev: int) -> torch.Tensor:
        """The draft distribution after `prev` under the current sampling config (cached;
        without penalties, which make it depend on the whole context)."""
        if prev not in self._q:
            self._q[prev] = probs(self.logits(prev), self.sampling)
        return self._q[prev]

    def start(self, prompt: Sequence[int], sampling: SamplingConfig, rng: Rng) -> None:
        self.sampling, self.rng = sampling, rng
        self.prompt_len = len(prompt)
        self._q = {}

    def _frontier_q(
        self, context: Sequence[int], tokens: list[int], parents: list[int], frontier: list[int]
    ) -> list[torch.Tensor]:
        """q after each frontier node; with penalties, each penalised for the committed
        tokens plus that node's own path."""
        if not self.sampling.penalized and self.constraint is None:
            return [self.q(tokens[u]) for u in frontier]
        tree, counts = TokenTree(tokens, parents), None
        if self.sampling.penalized:
            committed = PenaltyContext(context, self.prompt_len)
            counts = tree_token_counts(committed, tree, self.vocab_size, "cpu", rows=frontier)  # [n, V]
        logits = torch.stack([self.logits(tokens[u]) for u in frontier])  # [n, V]
        if self.constraint is not None:  # each row masked to what the grammar allows after its path
            paths = self.constraint.paths(tree)
            logits = self.constraint.mask_logits(logits, [paths[u] for u in frontier], draft=True)
        return list(probs(logits, self.sampling, counts))

    def propose(self, context: Sequence[int], depth: int) -> DraftTree:
        tokens, parents, counts = [int(context[-1])], [-1], [self.width]
        groups: list[ProposalGroup] = []
        frontier = [0]
        for _ in range(depth):
            new: list[int] = []
            for u, q in zip(frontier, self._frontier_q(context, tokens, parents, frontier)):
                draws = self.rng.categorical(q, counts[u])
                child_of: dict[int, int] = {}
                for x in draws:
                    if x in child_of:
                        counts[child_of[x]] += 1
                    else:
                        tokens.append(x)
                        parents.append(u)
                        counts.append(1)
                        child_of[x] = len(tokens) - 1
                        new.append(child_of[x])
                groups.append(ProposalGroup(u, Draw.IID, tuple(draws), tuple(child_of[x] for x in draws), q))
            frontier = new
        return DraftTree(TokenTree(tokens, parents), tuple(groups))


class UnigramDrafter(CountDrafter):
    """Draws every token from the corpus unigram distribution, whatever the context."""

    def __init__(
        self,
        counts: np.ndarray | torch.Tensor | None = None,
        width: int = 1,
        smoothing: float = 1.0,
        counts_file: str | Path | None = None,
    ):
        """`counts`: [V] counts, or None for those of `counts_file` (default: the bundled ones)."""
        super().__init__(width)
        if smoothing <= 0:
            raise ValueError(f"smoothing must be > 0 (it keeps every token possible), got {smoothing!r}")
        c = load_counts(counts_file)["unigram"] if counts is None else counts
        c = torch.as_tensor(np.asarray(c, dtype=np.float64))
        if c.ndim != 1 or (c < 0).any():
            raise ValueError("unigram counts must be a [V] vector of non-negative numbers")
        self.vocab_size = c.numel()
        self._logits = torch.log(c + smoothing)

    def logits(self, prev: int) -> torch.Tensor:
        return self._logits


class BigramDrafter(CountDrafter):
    """Draws each token from the corpus bigram distribution given the previous token.

    `bigram`: a dense [V, V] count matrix, or None for the sparse counts of `counts_file`
    (default: the bundled ones); `unigram`: the [V] counts of the prior (default: the bigram
    row sums, or the file's).
    """

    def __init__(
        self,
        bigram: np.ndarray | torch.Tensor | None = None,
        unigram: np.ndarray | torch.Tensor | None = None,
        width: int = 1,
        smoothing: float = 1.0,
        counts_file: str | Path | None = None,
    ):
        super().__init__(width)
        if smoothing <= 0:
            raise ValueError(f"smoothing must be > 0 (it keeps every token possible), got {smoothing!r}")
        if bigram is None:
            f = load_counts(counts_file)
            self.vocab_size = V = int(f["unigram"].size)
            uni = f["unigram"] if unigram is None else unigram
            indptr, idx, cnt = f["bigram_indptr"], f["bigram_indices"], f["bigram_counts"]
        else:
            b = np.asarray(bigram, dtype=np.float64)
            if b.ndim != 2 or b.shape[0] != b.shape[1] or (b < 0).any():
                raise ValueError("bigram counts must be a [V, V] matrix of non-negative numbers")
            self.vocab_size = V = b.shape[0]
            uni = b.sum(0) if unigram is None else unigram
            rows, idx = np.nonzero(b)  # row-major: CSR order
            cnt = b[rows, idx]
            indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=V))])
        # CSR rows: the counts of the tokens that followed `prev`
        self._indptr = np.asarray(indptr, dtype=np.int64)
        self._indices = torch.as_tensor(np.asarray(idx, dtype=np.int64))
        self._counts = torch.as_tensor(np.asarray(cnt, dtype=np.float64))
        uni = torch.as_tensor(np.asarray(uni, dtype=np.float64))
        if uni.shape != (V,) or (uni < 0).any():
            raise ValueError("unigram prior counts must be a [V] vector of non-negative numbers")
        # prior pseudo-counts: smoothing * P_unigram (itself add-one smoothed, so never zero)
        self._prior = smoothing * (uni + 1.0) / (uni + 1.0).sum()

    def logits(self, prev: int) -> torch.Tensor:
        row = self._prior.clone()
        lo, hi = self._indptr[prev], self._indptr[prev + 1]
        row[self._indices[lo:hi]] += self._counts[lo:hi]
        return torch.log(row)
