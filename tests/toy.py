"""Test doubles: table-defined toy language models and an Rng that enumerates every outcome.

`TableRunner` is a real `Runner` (so the production cache bookkeeping is what gets tested):
it keeps the token of every cache slot and computes each node's logits from the tokens it is
allowed to see. A wrong mask or position therefore gives a wrong context, hence a wrong
distribution, and the exactness tests fail.

`enumerate_outcomes(fn)` runs `fn(rng)` once per possible sequence of random choices, with
an `Rng` that follows a script of choices and multiplies the probabilities of what it chose.
The result maps each outcome to its exact probability.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Callable, Hashable

import torch
from hypothesis import strategies as st

from treespec import SpeculativeDecoder, TokenTree
from treespec.backends.base import Runner, Scores
from treespec.config import SamplingConfig
from treespec.rng import Rng
from treespec.sampling import probs


class TableModel:
    """Next-token logits as a deterministic function of the context (a lazily built table).

    `base` makes a correlated model: its logits are `base`'s plus `noise` times fresh ones,
    so a draft built on the target agrees with it often but not always.
    """

    def __init__(
        self,
        vocab_size: int,
        seed: int,
        scale: float = 1.5,
        base: TableModel | None = None,
        noise: float = 1.0,
    ):
        self.vocab_size, self.seed, self.scale, self.base, self.noise = vocab_size, seed, scale, base, noise
        self._table: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(self, context: tuple[int, ...]) -> torch.Tensor:
        if context not in self._table:
            g = torch.Generator().manual_seed(zlib.crc32(bytes(str((self.seed, context)), "utf8")))
            own = torch.randn(self.vocab_size, generator=g, dtype=torch.float64) * self.scale
            self._table[context] = own if self.base is None else self.base.logits(context) + self.noise * own
        return self._table[context]

    def joint(
        self, prompt: tuple[int, ...], n: int, sampling: SamplingConfig
    ) -> dict[tuple[int, ...], float]:
        """Exact distribution of the next n tokens under autoregressive sampling (penalties
        applied by `reference_penalties`, written independently of treespec's)."""
        out: dict[tuple[int, ...], float] = {(): 1.0}
        plain = SamplingConfig(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        for _ in range(n):
            nxt: dict[tuple[int, ...], float] = {}
            for seq, w in out.items():
                p = probs(reference_penalties(self.logits(prompt + seq), prompt, seq, sampling), plain)
                for x in torch.nonzero(p).flatten().tolist():
                    nxt[seq + (x,)] = w * float(p[x])
            out = nxt
        return out


def reference_penalties(
    logits: torch.Tensor, prompt: tuple[int, ...], generated: tuple[int, ...], cfg: SamplingConfig
) -> torch.Tensor:
    """The penalties token by token, as Hugging Face's RepetitionPenaltyLogitsProcessor
    (prompt + generated) and vLLM's frequency / presence penalties (generated only) define them."""
    out = logits.clone()
    for x in range(len(out)):
        if x in prompt or x in generated:
            out[x] = out[x] * cfg.repetition_penalty if out[x] < 0 else out[x] / cfg.repetition_penalty
        n = generated.count(x)
        out[x] -= cfg.frequency_penalty * n + cfg.presence_penalty * (n > 0)
    return out


class TableRunner(Runner):
    """`n_layers` layers to tap: the feature of layer t at a node is the model's logits for the
    node's context times (t + 1), so features are a function of exactly what the node sees."""

    n_layers = 3

    def __init__(self, model: TableModel, max_positions: int | None = None, eos_token_ids=()):
        self.model, self.vocab_size, self.max_positions = model, model.vocab_size, max_positions
        self.eos_token_ids = frozenset(eos_token_ids)
        super().__init__()

    def new_lane(self) -> TableRunner:
        lane = TableRunner(self.model, self.max_positions, self.eos_token_ids)
        lane.taps = self.taps
        return lane

    def reset_cache(self) -> None:
        self.slots: list[int] = []  # token of every cache slot

    def forward(self, tokens, positions, visible, need_logits):
        tokens, positions = tokens.tolist(), positions.tolist()
        n, s = len(tokens), len(self.slots)
        if visible is None:  # prefill: causal
            visible = torch.ones(n, s + n, dtype=torch.bool).tril(s)
        assert visible.shape == (n, s + n)
        all_tokens = self.slots + list(tokens)
        rows = []
        for i in range(n):
            ctx = tuple(t for t, v in zip(all_tokens, visible[i].tolist()) if v)
            assert int(positions[i]) == len(ctx) - 1, (
                "position id must equal the number of tokens seen before"
            )
            assert visible[i, s + i], "a node must see itself"
            rows.append(self.model.logits(ctx))
        self.slots = all_tokens
        logits = torch.stack(rows)  # [n, V]
        features = torch.cat([logits * (t + 1) for t in self.taps], -1) if self.taps else None
        return Scores(logits if need_logits else None, features)

    def keep_slots(self, nodes):
        c = self.n_committed
        self.slots = self.slots[:c] + [self.slots[c + n] for n in nodes]

    def truncate(self, n_slots):
        self.slots = self.slots[:n_slots]


class ScriptRng(Rng):
    """Follows `script` (an index into each choice point's options), then takes option 0."""

    def __init__(self, script: list[int]):
        self.script, self.taken, self.n_options, self.weight = script, [], [], 1.0

    def _choose(self, options: list[tuple[object, float]]):
        options = [(v, w) for v, w in options if w > 0]
        k = len(self.taken)
        i = self.script[k] if k < len(self.script) else 0
        self.taken.append(i)
        self.n_options.append(len(options))
        value, w = options[i]
        self.weight *= w
        return value

    def categorical(self, probs: torch.Tensor, n: int = 1) -> list[int]:
        p = probs.double()
        p = (p / p.sum()).tolist()
        return [self._choose(list(enumerate(p))) for _ in range(n)]

    def bernoulli(self, prob: float) -> bool:
        prob = min(1.0, max(0.0, float(prob)))
        return self._choose([(True, prob), (False, 1.0 - prob)])


def enumerate_outcomes(fn: Callable[[Rng], Hashable]) -> dict[Hashable, float]:
    """Exact distribution of `fn(rng)` over every possible sequence of random choices."""
    dist: dict[Hashable, float] = defaultdict(float)
    script: list[int] = []
    while True:
        rng = ScriptRng(script)
        dist[fn(rng)] += rng.weight
        taken, n_options = rng.taken, rng.n_options
        while taken and taken[-1] + 1 >= n_options[-1]:  # odometer over choice sequences
            taken.pop()
            n_options.pop()
        if not taken:
            return dict(dist)
        script = taken[:-1] + [taken[-1] + 1]


def max_abs_diff(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


# ---- the enumeration tests' toy pair ----------------------------------------------------
V = 3  # toy vocabulary


K = 3  # tokens generated per enumerated run (spans several rounds when depth < K - 1)


PROMPT = (1, 0)


SAMPLINGS = {
    "T1": SamplingConfig(temperature=1.0),
    "T0.6-topk2": SamplingConfig(temperature=0.6, top_k=2),
    "T1.4-topp0.7": SamplingConfig(temperature=1.4, top_p=0.7),
}


LONG_PROMPT = (1, 0, 2, 1, 0)  # gives the model-free drafters something to match


def pair(draft_noise: float = 0.8):
    target = TableModel(V, seed=11)
    draft = TableModel(V, seed=12, base=target, noise=draft_noise)
    return target, draft


def enumerate_decoder(decoder: SpeculativeDecoder, tree, sampling, k: int = K):
    def run(rng):
        out = decoder.generate(list(PROMPT), k, tree=tree, sampling=sampling, rng=rng, ignore_eos=True)
        assert len(out.token_ids) == k
        return tuple(out.token_ids)

    return enumerate_outcomes(run)


@st.composite
def trees(draw, max_nodes: int = 24):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    return TokenTree(tokens, parents)


class TableHead(Runner):
    """A table-defined feature head over a `TableRunner` target (what the enumeration tests
    draft with): slot t holds (hidden, token t+1) at position t, and its q is the `draft`
    model's for the context it sees. It checks every hidden state it is fed, so the tests fail
    on any misaligned feature: a row fed from the target must carry, marked 1 in its last
    column, the target's features at position t (`project` keeps the first tap's block, the
    target's logits there); a drafted row, marked 0, its parent's output state (the draft's
    logits for the parent's context). `first` is the prompt's first token, which no slot holds."""

    takes_hidden = True

    def __init__(self, target: TableModel, draft: TableModel, first: int, taps=(0, 2)):
        self.target, self.draft, self.first, self.target_taps = target, draft, first, tuple(taps)
        self.vocab_size, self.max_positions = target.vocab_size, None
        super().__init__()

    def new_lane(self) -> TableHead:
        return TableHead(self.target, self.draft, self.first, self.target_taps)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        V = self.vocab_size
        block = features[:, :V] / (self.target_taps[0] + 1)  # TableRunner's first tap
        return torch.cat([block, torch.ones(features.shape[0], 1, dtype=block.dtype)], -1)  # [n, V + 1]

    def reset_cache(self) -> None:
        self.slots: list[int] = []

    @classmethod
    def forward_many(cls, runners, feeds, need_logits):
        return [r._forward_fed(f) for r, f in zip(runners, feeds)]

    def forward(self, tokens, positions, visible, need_logits):
        raise AssertionError("a head is fed through forward_many, with its hidden states")

    def _forward_fed(self, feed) -> Scores:
        tokens, positions, hidden = feed.tokens.tolist(), feed.positions.tolist(), feed.hidden
        n, s = len(tokens), len(self.slots)
        visible = feed.visible if feed.visible is not None else torch.ones(n, s + n, dtype=torch.bool).tril(s)
        all_tokens = self.slots + tokens
        logits, states = [], []
        for i in range(n):
            seen = tuple(t for t, v in zip(all_tokens, visible[i].tolist()) if v)
            ctx = (self.first,) + seen  # the sequence up to and including this slot's token
            assert positions[i] == len(seen) - 1, "slot t sits at position t"
            from_target = bool(hidden[i, -1] == 1)
            want = (self.target if from_target else self.draft).logits(ctx[:-1])
            what = "target features" if from_target else "parent state"
            assert torch.allclose(hidden[i, :-1].double(), want, atol=1e-9), (
                f"slot {positions[i]} was fed the wrong {what}"
            )
            logits.append(self.draft.logits(ctx))
            states.append(torch.cat([self.draft.logits(ctx), torch.zeros(1, dtype=torch.float64)]))
        self.slots = all_tokens
        return Scores(torch.stack(logits), torch.stack(states))

    def keep_slots(self, nodes):
        c = self.n_committed
        self.slots = self.slots[:c] + [self.slots[c + n] for n in nodes]

    def truncate(self, n_slots):
        self.slots = self.slots[:n_slots]


class ToyTokenizer:
    """A tokenizer for toy vocabularies that the grammar engine can map (`tokens`: one bytes
    string per id; `eos_token_id`); tokenizes greedily, longest token first."""

    def __init__(self, tokens: list[bytes], eos_token_id: int):
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos_token_id, None
        self.special_token_ids = [eos_token_id]

    def __call__(self, text) -> list[int]:
        data = text.encode() if isinstance(text, str) else bytes(text)
        order = sorted(
            (i for i in range(len(self.tokens)) if i != self.eos_token_id), key=lambda i: -len(self.tokens[i])
        )
        out, i = [], 0
        while i < len(data):
            j = next((j for j in order if data[i:].startswith(self.tokens[j])), None)
            if j is None:  # a byte no token spells: skipped (the engine probes with arbitrary text)
                i += 1
                continue
            out.append(j)
            i += len(self.tokens[j])
        return out

    def decode(self, ids, skip_special_tokens=False) -> str:
        keep = [i for i in ids if not (skip_special_tokens and i == self.eos_token_id)]
        return b"".join(self.tokens[i] for i in keep).decode(errors="replace")
