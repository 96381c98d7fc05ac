"""Shared code of the notebooks: fast mode, the two pairs (`load_pair`), measurement loops, and the
drafters the notebooks compare (naive sampling, a deliberately lossy one), all on treespec's
public API.

`TREESPEC_FAST=1` (set by tests/test_notebooks.py) shrinks prompts, tokens and samples so
that every notebook runs in seconds; the committed outputs come from a full run
(`python notebooks/run_notebooks.py`).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from treespec import DraftTree, Drafter, Draw, GenerationStats, ProposalGroup, SamplingConfig, SpeculativeDecoder, TokenTree
from treespec.sampling import probs

warnings.filterwarnings("ignore", message="IProgress not found")
FAST = os.environ.get("TREESPEC_FAST", "") not in ("", "0")
torch.set_num_threads(int(os.environ.get("TREESPEC_THREADS", "1")))


def pick(full, fast):
    """`full` normally, `fast` under TREESPEC_FAST=1."""
    return fast if FAST else full


@dataclass
class Pair:
    """A (target p, draft q) pair as the notebooks measure it: HF models for the logits, a
    decoder for decoding and timing, and the pair's own held-out prompts and count drafts."""

    name: str
    target: torch.nn.Module  # HF causal LM (p), fp32, sdpa
    draft: torch.nn.Module  # HF causal LM over the target's vocabulary (q; -inf outside a subset draft's)
    tokenizer: object  # the target's
    decoder: SpeculativeDecoder  # native runners, fp32: every decoding and timing cell
    draft_params: int  # parameters of the draft as shipped (its own vocabulary)
    draft_vocab: int  # tokens the draft can propose (a subset of the target's for smollm2)

    @property
    def target_params(self) -> int:
        """Parameters of the target (tied embeddings counted once)."""
        return sum(p.numel() for p in self.target.parameters())

    @property
    def counts_file(self) -> Path:
        """Token counts of the pair's own corpus (`UnigramDrafter` / `BigramDrafter`)."""
        from treespec.zoo import counts_file

        return counts_file(self.name)

    def count_drafters(self) -> dict[str, Drafter]:
        """The unigram and bigram drafts of Leviathan's Table 3, from `counts_file`."""
        from treespec import BigramDrafter, UnigramDrafter

        return {"unigram": UnigramDrafter(counts_file=self.counts_file), "bigram": BigramDrafter(counts_file=self.counts_file)}

    def counts_corpus(self) -> str:
        """What `counts_file` counted (its metadata): corpus and number of tokens."""
        import json

        from treespec.drafters.counts import load_counts

        meta = json.loads(str(load_counts(self.counts_file)["meta"]))
        return f"{meta.get('corpus', 'unknown corpus')}; {meta.get('tokens', 0):,} tokens"

    def prompts(self, n: int) -> list[list[int]]:
        """n held-out prompts as token ids: chat instructions rendered with the chat template
        (smollm2, a chat model), openings of Python files (pycode)."""
        from treespec.zoo import heldout_prompt_ids

        return heldout_prompt_ids(self.name, self.tokenizer, n)


@functools.cache
def load_pair(name: str = "pycode") -> Pair:
    """The named pair of `treespec.zoo` ("smollm2" or "pycode"), fp32, sdpa; loaded once per
    process. A subset-vocabulary draft (smollm2's) is widened to the target's vocabulary for
    the HF consumers (`backends.subset.full_vocabulary_model`: the same q, 0 outside the subset)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from treespec.backends.subset import VocabMap, full_vocabulary_model
    from treespec.loading import checkpoint
    from treespec.zoo import pair

    hf_logging.disable_progress_bar()
    target_path, draft_path = pair(name)
    target_dir = checkpoint(target_path)  # smollm2: the cached HF directory converted from the GGUF
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32, attn_implementation="sdpa").eval()  # noqa: E731
    target, draft = load(target_dir), load(draft_path)
    draft_params, draft_vocab = sum(p.numel() for p in draft.parameters()), draft.config.vocab_size
    vocab_map = VocabMap.load(draft_path)
    if vocab_map is not None:
        draft, draft_vocab = full_vocabulary_model(draft, vocab_map), vocab_map.size
    decoder = SpeculativeDecoder.from_pretrained(target=target_path, draft=draft_path, dtype="float32")
    return Pair(name, target, draft, AutoTokenizer.from_pretrained(target_dir), decoder, draft_params, draft_vocab)


def run(dec, prompts: Sequence[Sequence[int]], max_new_tokens: int, tree, sampling: SamplingConfig, seed: int = 0) -> GenerationStats:
    """Pooled stats of one generation per prompt (seed + i for prompt i)."""
    total = GenerationStats()
    for i, ids in enumerate(prompts):
        total.add(dec.generate(list(ids), max_new_tokens, tree=tree, sampling=sampling, seed=seed + i, ignore_eos=True).stats)
    return total


@torch.inference_mode()
def continuation_logits(pair: Pair, prompts, n_tokens: int, sampling: SamplingConfig, seed: int = 0):
    """The target samples `n_tokens` after each prompt (plain decoding); returns, for every
    generated position, (target logits, draft logits, previous token) stacked over prompts:
    the states verification meets. Draft logits are over the target's vocabulary."""
    P, Q, prev = [], [], []
    for i, ids in enumerate(prompts):
        cont = pair.decoder.generate(list(ids), n_tokens, tree=None, sampling=sampling, seed=seed + i, ignore_eos=True).token_ids
        seq = torch.tensor([list(ids) + cont])
        start = len(ids) - 1
        P.append(pair.target(seq).logits[0, start:-1])
        Q.append(pair.draft(seq).logits[0, start:-1])
        prev += seq[0, start:-1].tolist()
    return torch.cat(P), torch.cat(Q), prev


# ---------------------------------------------------------------------------- drafters
class HFTreeDrafter(Drafter):
    """An i.i.d. draft tree from an HF causal LM, without a KV cache (each depth is one batched
    forward over context + path of every frontier node; all paths at a depth have one length).

    mode="mss":   `width` sequences drawn i.i.d. from q, merged into a prefix tree; the m draws
                  at a node are one Draw.IID group carrying q: multi-step speculative sampling
                  (SpecInfer) / iterative speculative sampling (Stratos).
    mode="naive": the same draws, verified as deterministic proposals (distinct tokens, in draw
                  order). Verifying deterministic children x1, x2, ... follows child x_j with
                  probability exactly p(x_j) (after rejecting x1 the residual is p without x1,
                  renormalised, and so on): this IS SpecInfer's naive sampling (sample from p,
                  accept if it is a child). Lossless too, but it ignores q.
    """

    def __init__(self, model, width: int, mode: str = "mss"):
        if mode not in ("mss", "naive"):
            raise ValueError(f"mode must be 'mss' or 'naive', got {mode!r}")
        self.model, self.width, self.mode = model, width, mode

    def start(self, prompt, sampling, rng):
        self.sampling, self.rng = sampling, rng

    @torch.inference_mode()
    def q_at(self, context, paths) -> torch.Tensor:
        x = torch.tensor([list(context) + p for p in paths])
        return probs(self.model(x, logits_to_keep=1).logits[:, -1].double(), self.sampling)

    def propose(self, context, depth):
        tokens, parents, count, path_of = [int(context[-1])], [-1], [self.width], [[]]
        groups, frontier = [], [0]
        for _ in range(depth):
            qs = self.q_at(context, [path_of[u] for u in frontier])
            new = []
            for u, q in zip(frontier, qs):
                draws = self.rng.categorical(q, count[u])
                child_of: dict[int, int] = {}
                for x in draws:
                    if x in child_of:
                        count[child_of[x]] += 1
                        continue
                    tokens.append(x)
                    parents.append(u)
                    count.append(1)
                    path_of.append(path_of[u] + [x])
                    child_of[x] = len(tokens) - 1
                    new.append(child_of[x])
                if self.mode == "naive":
                    distinct = list(child_of)
                    groups.append(ProposalGroup(u, Draw.DETERMINISTIC, tuple(distinct), tuple(child_of[x] for x in distinct)))
                else:
                    groups.append(ProposalGroup(u, Draw.IID, tuple(draws), tuple(child_of[x] for x in draws), q))
            frontier = new
        return DraftTree(TokenTree(tokens, parents), tuple(groups))


class LossyTopKDrafter(HFTreeDrafter):
    """Deliberately NOT lossless: the `width` most likely draft tokens at the root (deterministic
    top-k), each continued by its draft argmax chain, but declared as i.i.d. draws from q, so the
    walk applies the p/q acceptance ratio to tokens that were never drawn from q."""

    def __init__(self, model, width: int):
        super().__init__(model, width)

    def propose(self, context, depth):
        tokens, parents, groups = [int(context[-1])], [-1], []
        q = self.q_at(context, [[]])[0]
        top = torch.topk(q, min(self.width, int((q > 0).sum()))).indices.tolist()
        groups_root, paths = [], []
        for x in top:
            tokens.append(x)
            parents.append(0)
            groups_root.append(len(tokens) - 1)
            paths.append([x])
        groups.append(ProposalGroup(0, Draw.IID, tuple(top), tuple(groups_root), q))
        leaves = list(groups_root)
        for _ in range(depth - 1):
            qs = self.q_at(context, paths)
            for i, (u, qu) in enumerate(zip(leaves, qs)):
                x = int(qu.argmax())
                tokens.append(x)
                parents.append(u)
                groups.append(ProposalGroup(u, Draw.IID, (x,), (len(tokens) - 1,), qu))
                leaves[i] = len(tokens) - 1
                paths[i] = paths[i] + [x]
        return DraftTree(TokenTree(tokens, parents), tuple(groups))


def iterative_speculative_sampling(p: np.ndarray, q: np.ndarray, k: int, rng: np.random.Generator) -> tuple[int, int | None]:
    """One position of iterative speculative sampling, written out in numpy (Stratos' notes):
    k drafts x_i ~ q i.i.d.; accept x_i w.p. min(1, r(x_i)/q(x_i)) with r the running residual
    (r <- norm(max(r - q, 0)) after each rejection); if all are rejected, sample from r.
    Returns (token, index of the accepted draft or None)."""
    r = p.copy()
    for i, x in enumerate(rng.choice(len(q), size=k, p=q)):
        if rng.random() < min(1.0, r[x] / q[x]):
            return int(x), i
        diff = np.maximum(r - q, 0)
        if diff.sum() > 1e-12:
            r = diff / diff.sum()
    return int(rng.choice(len(r), p=r)), None


def iss_acceptance_exact(p: np.ndarray, q: np.ndarray, k: int) -> float:
    """P(some of k i.i.d. drafts is accepted) exactly: each trial accepts w.p. sum min(r, q)
    with the residual r of the trials before (the residual does not depend on which token
    was rejected)."""
    r, reject = p.copy(), 1.0
    for _ in range(k):
        reject *= 1.0 - np.minimum(r, q).sum()
        diff = np.maximum(r - q, 0)
        if diff.sum() <= 1e-15:
            return 1.0 - reject
        r = diff / diff.sum()
    return 1.0 - reject


# ---------------------------------------------------------------------- distributions
def tv(counts: dict, exact: dict, n: int) -> float:
    """Total variation distance between empirical counts (n samples) and an exact law."""
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)


def tiny_llama(seed: int, vocab: int = 8, hidden: int = 32, layers: int = 2, noise: float | None = None, base=None):
    """A tiny random Llama in float64 (as tests/conftest.py builds them); with `base` and
    `noise`, a draft: the base's weights plus Gaussian noise."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    if base is not None:
        m = copy.deepcopy(base)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * noise * p.std())
        return m
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0,
                      eos_token_id=1, attn_implementation="sdpa")
    m = LlamaForCausalLM(cfg).to(torch.float64).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)
    return m


@torch.inference_mode()
def exact_joint(model, prompt: Sequence[int], k: int, sampling: SamplingConfig) -> dict[tuple[int, ...], float]:
    """P(x1..xk | prompt) under autoregressive sampling of `model`, exactly (V^(k-1) rows)."""
    import itertools

    V = model.config.vocab_size
    seqs = list(itertools.product(range(V), repeat=k - 1))
    logits = model(torch.tensor([list(prompt) + list(s) for s in seqs])).logits
    step = probs(logits[:, len(prompt) - 1 :], sampling).numpy()  # [rows, k, V]
    joint = {}
    for i, s in enumerate(seqs):
        pre = np.prod([step[i, j, s[j]] for j in range(k - 1)]) if k > 1 else 1.0
        for x in range(V):
            joint[s + (x,)] = float(pre * step[i, k - 1, x])
    return joint


# ------------------------------------------------------------------------------ Sequoia
@torch.inference_mode()
def positional_acceptance(P: torch.Tensor, Q: torch.Tensor, sampling: SamplingConfig, K: int = 8, trials: int = 64, seed: int = 0) -> list[float]:
    """Sequoia's positional acceptance vector a[k] = P(the k-th of K draws without replacement
    from q is the accepted child), averaged over the rows of target logits P and draft logits Q.

    Temperature 0: exact (1 iff the draft's k-th most likely token is argmax p). Otherwise Monte
    Carlo, `trials` walks per row, vectorised, with the rule the library documents for a
    without-replacement group: the k-th draw x from q_k is accepted w.p. min(1, r(x) / q_k(x));
    on rejection r <- norm(max(r - q_k, 0)) and q_{k+1} = q_k without x, renormalised.
    """
    hits = torch.zeros(K, dtype=torch.float64)
    if sampling.greedy:
        best = P.argmax(-1)
        order = Q.topk(K, dim=-1).indices
        hits = (order == best[:, None]).double().sum(0)
        return (hits / P.shape[0]).tolist()
    g = torch.Generator().manual_seed(seed)
    for p, q in zip(probs(P.double(), sampling), probs(Q.double(), sampling)):
        outside = q == 0
        if outside.any():  # tokens q never draws (a subset draft's): one column, exactly (q = 0 there, r keeps its mass)
            p, q = torch.cat([p[~outside], p[outside].sum()[None]]), torch.cat([q[~outside], q.new_zeros(1)])
        k = min(K, int((q > 0).sum()))
        gumbel = -torch.log(-torch.log(torch.rand(trials, q.numel(), generator=g, dtype=torch.float64)))
        draws = (torch.log(q)[None] + gumbel).topk(k, dim=-1).indices  # [trials, k]: Gumbel-top-k
        r = p.expand(trials, -1).clone()
        qk = q.expand(trials, -1).clone()
        alive = torch.ones(trials, dtype=torch.bool)
        rows = torch.arange(trials)
        for j in range(k):
            x = draws[:, j]
            ratio = (r[rows, x] / qk[rows, x]).clamp(max=1.0)
            acc = alive & (torch.rand(trials, generator=g, dtype=torch.float64) < ratio)
            hits[j] += acc.sum()
            alive &= ~acc
            diff = (r - qk).clamp(min=0)
            mass = diff.sum(-1, keepdim=True)
            r = torch.where(mass > 1e-12, diff / mass.clamp(min=1e-300), r)
            qk[rows, x] = 0
            qk = qk / qk.sum(-1, keepdim=True).clamp(min=1e-300)
    return (hits / (P.shape[0] * trials)).tolist()


def kxd_parents(k: int, d: int) -> tuple[int, ...]:
    """SpecInfer-style k x d: k branches at the root, each a chain of d tokens (k*d nodes)."""
    parents = [-1] + [0] * k
    for b in range(k):
        prev = b + 1
        for _ in range(d - 1):
            parents.append(prev)
            prev = len(parents) - 1
    return tuple(parents)


def binary_parents(n: int) -> tuple[int, ...]:
    """The first n nodes (breadth first) of the complete binary tree: a balanced k-ary tree, k = 2."""
    from treespec import theory

    depth = max(1, int(np.ceil(np.log2(n + 1))))
    return theory.kary_parents(2, depth)[: n + 1]
