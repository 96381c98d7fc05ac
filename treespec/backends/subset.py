"""Subset-vocabulary drafts: the draft knows only the K tokens the target emits most.

The draft is a standard Llama checkpoint whose vocabulary is K + 1 rows: row r < K stands for
the target token `ids[r]`, row K for every other token (read as input, never proposed). A
draft's cost is dominated by its output layer when the vocabulary is large (49,152 rows of
576 for SmolLM2), so K << V cuts both the lm_head product and the embedding table.

`vocab_map.json` in the draft directory holds `ids` (the K target ids, in row order) and the
target's vocabulary size; `treespec.loading.load_runner` wraps any checkpoint that has one
(`treespec distill --vocab-subset K` writes such drafts). `SubsetVocabRunner` wraps the
draft's runner: it feeds the draft its own rows and scatters the K output logits into the
target's V columns with -inf elsewhere, so q is exactly zero outside the subset.
Verification accepts any q as long as the q stored with a proposal is the one it was drawn
from, so decoding stays lossless; the only price is acceptance: alpha <= the target's mass
inside the subset.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .base import Feed, PendingNodes, Runner, Scores, forward_grouped

MAP_FILE = "vocab_map.json"


class VocabMap:
    """Target ids <-> draft rows for a K-token subset of a V-token target vocabulary."""

    def __init__(self, ids, target_vocab: int):
        self.ids = torch.as_tensor(ids, dtype=torch.long)  # [K] target id of draft row r
        self.target_vocab = int(target_vocab)
        if self.ids.ndim != 1 or len(self.ids) == 0 or len(torch.unique(self.ids)) != len(self.ids):
            raise ValueError("a vocabulary subset needs distinct target ids")
        if int(self.ids.min()) < 0 or int(self.ids.max()) >= self.target_vocab:
            raise ValueError(f"subset ids must lie in [0, {self.target_vocab})")
        self.row_of = torch.full(
            (self.target_vocab,), -1, dtype=torch.long
        )  # [V] row of a target id, -1 outside
        self.row_of[self.ids] = torch.arange(len(self.ids))

    @property
    def size(self) -> int:
        """K: the proposable rows (the draft has K + 1, the last for every other token)."""
        return len(self.ids)

    def input_rows(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft input rows of target ids (row K for ids outside the subset); any shape."""
        rows = self.row_of.to(target_ids.device)[target_ids]
        return torch.where(rows < 0, self.size, rows)

    def output_rows(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Draft output rows of target ids, -1 outside the subset; any shape."""
        return self.row_of.to(target_ids.device)[target_ids]

    def save(self, directory: Path) -> None:
        data = {"target_vocab_size": self.target_vocab, "ids": self.ids.tolist()}
        (Path(directory) / MAP_FILE).write_text(json.dumps(data) + "\n")

    @classmethod
    def load(cls, directory: Path) -> VocabMap | None:
        path = Path(directory) / MAP_FILE
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls(data["ids"], data["target_vocab_size"])


def wrap(runner: Runner, vocab_map: VocabMap | None) -> Runner:
    """`runner` as the target's ids see it: wrapped when its model has a subset vocabulary."""
    return runner if vocab_map is None else SubsetVocabRunner(runner, vocab_map)


class SubsetVocabRunner(Runner):
    """A draft runner over a subset vocabulary, seen by treespec as a runner over the target's
    V ids: input ids are mapped to draft rows, logits [n, K + 1] are scattered to [n, V] with
    -inf outside the subset. The runner bookkeeping (committed tokens, pending tree) lives in
    the wrapped runner, so its own cache arithmetic stays what it is tested for."""

    def __init__(self, inner: Runner, vocab_map: VocabMap):
        if inner.vocab_size != vocab_map.size + 1:
            raise ValueError(
                f"the draft has {inner.vocab_size} rows; its vocab map needs {vocab_map.size} + 1"
            )
        self.inner, self.map = inner, vocab_map
        self.vocab_size = vocab_map.target_vocab
        self.max_positions, self.n_layers = inner.max_positions, inner.n_layers
        self.device, self.dtype = inner.device, inner.dtype
        self.eos_token_ids = frozenset(
            int(vocab_map.ids[e]) for e in inner.eos_token_ids if e < vocab_map.size
        )
        self._ids = vocab_map.ids.to(inner.device)  # [K]
        self._rows = vocab_map.input_rows(torch.arange(vocab_map.target_vocab)).to(inner.device)  # [V]
        super().__init__()

    # the bookkeeping state of `Runner` is the wrapped runner's
    @property
    def committed(self) -> list[int]:
        return self.inner.committed

    @committed.setter
    def committed(self, tokens: list[int]) -> None:
        self.inner.committed = tokens

    @property
    def pending(self) -> PendingNodes:
        return self.inner.pending

    @pending.setter
    def pending(self, nodes: PendingNodes) -> None:
        self.inner.pending = nodes

    def set_taps(self, taps) -> None:
        self.inner.set_taps(taps)
        self.taps = self.inner.taps

    def load_graphs(self) -> None:
        self.inner.load_graphs()

    def scatter(self, scores: Scores) -> Scores:
        """Draft logits [n, K + 1] -> [n, V] target logits, -inf outside the subset."""
        logits = scores.logits
        if logits is None:
            return scores
        out = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        out[:, self._ids] = logits[:, : self.map.size]
        return Scores(out, scores.features)

    def draft_feed(self, feed: Feed) -> Feed:
        """`feed` with the draft's input rows for its target ids."""
        return Feed(self._rows[feed.tokens], feed.positions, feed.visible, feed.hidden)

    def reset_cache(self) -> None:
        self.inner.reset_cache()

    def forward(self, tokens, positions, visible, need_logits):
        return self.scatter(self.inner.forward(self._rows[tokens], positions, visible, need_logits))

    def keep_slots(self, nodes: list[int]) -> None:
        self.inner.keep_slots(nodes)

    def truncate(self, n_slots: int) -> None:
        self.inner.truncate(n_slots)

    @property
    def lanes_match_solo(self) -> bool:
        return self.inner.lanes_match_solo

    def lanes(self, n: int) -> list[Runner]:
        return [SubsetVocabRunner(lane, self.map) for lane in self.inner.lanes(n)]

    @classmethod
    def forward_many(cls, runners, feeds, need_logits):
        """The wrapped lanes' own (batched) forward, then one scatter per lane."""
        inner = forward_grouped(
            [r.inner for r in runners],
            [r.draft_feed(f) for r, f in zip(runners, feeds)],
            type,
            lambda group, fs: type(group[0]).forward_many(group, fs, need_logits),
        )
        return [r.scatter(out) for r, out in zip(runners, inner)]


def full_vocabulary_model(model: torch.nn.Module, vocab_map: VocabMap) -> torch.nn.Module:
    """A copy of the HF draft `model` (K + 1 rows) over the target's V ids with the same
    distribution as `SubsetVocabRunner`: input embeddings gathered by `input_rows`, an output
    layer of V rows whose bias is -inf outside the subset. What a consumer that needs the
    target's vocabulary (Hugging Face assisted generation) can run."""
    import copy

    full = copy.deepcopy(model)
    V = vocab_map.target_vocab
    rows = vocab_map.input_rows(torch.arange(V))  # [V] draft row of every target id
    emb = model.get_input_embeddings().weight.detach()  # [K + 1, h]
    head = model.get_output_embeddings().weight.detach()  # [K + 1, h]
    full.set_input_embeddings(torch.nn.Embedding.from_pretrained(emb[rows].clone(), freeze=False))
    out = torch.nn.Linear(emb.shape[1], V, bias=True, dtype=head.dtype, device=head.device)
    with torch.no_grad():
        out.weight.copy_(head[rows])
        out.bias.fill_(float("-inf"))
        out.bias[vocab_map.ids.to(head.device)] = 0
    full.set_output_embeddings(out)
    full.config.vocab_size = V
    full.config.tie_word_embeddings = False
    return full.eval()
