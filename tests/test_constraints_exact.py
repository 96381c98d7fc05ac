"""Constrained decoding is lossless with respect to the constrained target, proven by
enumeration: a toy grammar over a toy vocabulary, every verification rule, every drafter.

The constrained target at a context is the target's logits masked to the tokens the grammar
allows there (the mask read here straight from a fresh llguidance matcher, independently of
the tree code), then the sampling transforms. Generation ends at EOS or when the grammar is
complete. The emitted joint distribution must equal that target's to 1e-9.
"""

from __future__ import annotations

import llguidance
import numpy as np
import pytest
import torch

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.constraints import GrammarVocabulary, Regex
from treespec.constraints.matcher import TreeMatcher
from treespec.proposal import DraftTree, Draw
from treespec.sampling import probs
from treespec.sequoia import TreeShape

from .mc import models  # noqa: F401 (fixture)
from .toy import TableHead, TableModel, TableRunner, ToyTokenizer, enumerate_outcomes, max_abs_diff

TOKENS = [b"a", b"b", b"ab", b"c", b"<eos>"]
EOS = 4
VT = len(TOKENS)
TOKENIZER = ToyTokenizer(TOKENS, EOS)
# at the start a, b, ab and c are allowed; after "a" only "b" (a forced token); after "c" only EOS
CONSTRAINT = Regex("(ab|b)*c")
PROMPT = (1, 0)
K = 3
SAMPLINGS = {
    "T1": SamplingConfig(temperature=1.0),
    "T0.6-topk2": SamplingConfig(temperature=0.6, top_k=2),
    "T1.4-topp0.7": SamplingConfig(temperature=1.4, top_p=0.7),
    "greedy": SamplingConfig(temperature=0),
}


def toy_pair():
    target = TableModel(VT, seed=31)
    return target, TableModel(VT, seed=32, base=target, noise=0.8)


def reference_mask(tokens: tuple[int, ...], tokenizer=TOKENIZER, constraint=CONSTRAINT) -> torch.Tensor:
    """What the grammar allows after `tokens`, from a fresh matcher (once it is complete: EOS)."""
    vocab = GrammarVocabulary.of(tokenizer, VT, (EOS,))
    m = llguidance.LLMatcher(vocab.tokenizer, constraint.grammar)
    assert m.consume_tokens(list(tokens))
    bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:VT]
    return torch.from_numpy(bits.astype(bool))


def constrained_joint(model: TableModel, sampling: SamplingConfig, k: int, grammar=None) -> dict:
    """The constrained target's distribution of its first k tokens (shorter at the end);
    `grammar`: (tokenizer, constraint), the first toy grammar's by default."""
    done: dict[tuple, float] = {}
    out: dict[tuple, float] = {(): 1.0}
    for _ in range(k):
        nxt: dict[tuple, float] = {}
        for seq, w in out.items():
            mask = reference_mask(seq, *(grammar or ()))
            p = probs(model.logits(PROMPT + seq).masked_fill(~mask, float("-inf")), sampling)
            for x in torch.nonzero(p).flatten().tolist():
                if x == EOS:
                    done[seq + (x,)] = done.get(seq + (x,), 0.0) + w * float(p[x])
                else:
                    nxt[seq + (x,)] = w * float(p[x])
        out = nxt
    for seq, w in out.items():
        done[seq] = done.get(seq, 0.0) + w
    return done


def enumerate_constrained(decoder, tree, sampling, verification=None, k=K, constraint=CONSTRAINT):
    def run(rng):
        out = decoder.generate(
            list(PROMPT),
            k,
            tree=tree,
            sampling=sampling,
            rng=rng,
            constraint=constraint,
            verification=verification,
        )
        assert out.finish_reason in ("eos", "stop", "length")
        return tuple(out.token_ids)

    return enumerate_outcomes(run)


def decoder_for(drafter="model", tokenizer=TOKENIZER):
    target, draft = toy_pair()
    return target, SpeculativeDecoder(
        TableRunner(target, eos_token_ids=(EOS,)), TableRunner(draft), tokenizer, drafter=drafter
    )


CASES = [
    # (strategy, width, depth, rule)
    ("iid", 1, 2, "token"),
    ("iid", 1, 2, "block"),
    ("iid", 1, 2, "traversal"),
    ("iid", 2, 1, "token"),
    ("without_replacement", 2, 1, "token"),
    ("without_replacement", 2, 1, "traversal"),
    ("topk", 2, 2, "traversal"),
    ("dynamic", 2, 2, "traversal"),
]


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
@pytest.mark.parametrize("strategy,width,depth,rule", CASES)
def test_model_drafter_is_lossless_under_a_grammar(strategy, width, depth, rule, sampling_name):
    sampling = SAMPLINGS[sampling_name]
    target, decoder = decoder_for()
    got = enumerate_constrained(
        decoder, TreeConfig(width=width, depth=depth, strategy=strategy), sampling, rule
    )
    want = constrained_joint(target, sampling, K)
    assert abs(sum(got.values()) - 1) < 1e-9
    assert max_abs_diff(got, want) < 1e-9
    if sampling.greedy:
        assert len(got) == 1


@pytest.mark.parametrize("sampling_name", ["T1", "greedy"])
@pytest.mark.parametrize("rule", ["token", "traversal"])
def test_sequoia_shape_and_feature_head_are_lossless_under_a_grammar(rule, sampling_name):
    """A Sequoia shape drafted by the model, and a feature head (its q masked through the same
    drafter code) drafting a chain, both under the grammar."""
    sampling = SAMPLINGS[sampling_name]
    target, decoder = decoder_for()
    want = constrained_joint(target, sampling, K)
    shape = TreeConfig(depth=2, strategy="sequoia", shape=TreeShape((-1, 0, 0, 1)))
    assert max_abs_diff(enumerate_constrained(decoder, shape, sampling, rule), want) < 1e-9
    _, draft = toy_pair()
    head = SpeculativeDecoder(
        TableRunner(target, eos_token_ids=(EOS,)), TableHead(target, draft, PROMPT[0]), TOKENIZER
    )
    assert max_abs_diff(enumerate_constrained(head, TreeConfig(1, 2), sampling, rule), want) < 1e-9


@pytest.mark.parametrize("sampling_name", ["T1", "greedy"])
@pytest.mark.parametrize("drafter", ["ngram", "lookup", "merged"])
def test_model_free_and_merged_drafters_are_lossless_under_a_grammar(drafter, sampling_name):
    sampling = SAMPLINGS[sampling_name]
    target, decoder = decoder_for(drafter)
    got = enumerate_constrained(decoder, TreeConfig(2, 2), sampling)
    assert max_abs_diff(got, constrained_joint(target, sampling, K)) < 1e-9


@pytest.mark.parametrize("sampling_name", ["T1", "greedy"])
def test_plain_decoding_is_the_constrained_target(sampling_name):
    sampling = SAMPLINGS[sampling_name]
    target, decoder = decoder_for()
    got = enumerate_constrained(decoder, None, sampling)
    assert max_abs_diff(got, constrained_joint(target, sampling, K)) < 1e-9


def test_the_constraint_changes_the_distribution():
    """The check above can fail: the unconstrained target is far from the constrained one."""
    target, decoder = decoder_for()

    def run(rng):
        out = decoder.generate(list(PROMPT), K, tree=TreeConfig(1, 2), sampling=SAMPLINGS["T1"], rng=rng)
        return tuple(out.token_ids)

    assert max_abs_diff(enumerate_outcomes(run), constrained_joint(target, SAMPLINGS["T1"], K)) > 1e-3


def test_forced_tokens_are_drafted_and_counted():
    """After "a" the grammar allows only "b": the tree carries it for free and it is accepted."""
    target, decoder = decoder_for()
    seen = []

    def run(rng):
        out = decoder.generate(
            list(PROMPT), K, tree=TreeConfig(1, 1), sampling=SAMPLINGS["T1"], rng=rng, constraint=CONSTRAINT
        )
        seen.append(out.stats)
        return tuple(out.token_ids)

    got = enumerate_outcomes(run)
    assert max_abs_diff(got, constrained_joint(target, SAMPLINGS["T1"], K)) < 1e-9
    assert max(s.forced_accepted for s in seen) > 0
    assert all(s.forced_accepted <= s.forced_tokens for s in seen)


# a forced string more than one spelling can write: after "a" the grammar forces "b", which
# "b" writes, or "bc" (the forced "b" and a free "c"); the tree drafts the tokenizer's
# spelling ("b"), a guess the target may reject, not a certain token
STRING_TOKENS = [b"a", b"b", b"c", b"bc", b"<eos>"]
STRING_TOKENIZER = ToyTokenizer(STRING_TOKENS, EOS)
STRING_CONSTRAINT = Regex("(abc?|c)+")


def test_a_forced_string_is_drafted_in_the_tokenizers_spelling():
    vocab = GrammarVocabulary.of(STRING_TOKENIZER, VT, (EOS,))
    matcher = TreeMatcher(vocab, STRING_CONSTRAINT)
    assert matcher.forced([0]) is None and matcher.forced_string([0]) == [1]  # "b" after "a"
    assert matcher.forced_string([]) == [] and matcher.forced_string([0, 1]) == []
    assert matcher.extend_forced(DraftTree.root_only(0), room=4).tree.tokens == (0,)
    chain = matcher.extend_forced(DraftTree.from_paths(0, [[0]]), room=4)  # a drafted "a"
    assert chain.tree.tokens == (0, 0, 1) and chain.groups[-1].draw is Draw.DETERMINISTIC


@pytest.mark.parametrize("sampling_name", ["T1", "T0.6-topk2", "greedy"])
@pytest.mark.parametrize(
    "tree,rule",
    [
        (None, None),
        ((1, 1, "iid"), "token"),
        ((1, 2, "iid"), "block"),
        ((2, 2, "without_replacement"), "traversal"),
    ],
)
def test_drafted_forced_strings_are_lossless(tree, rule, sampling_name):
    """The string's spelling is a guess the target may reject ("b" then "c"): every rule keeps
    the constrained target's distribution."""
    sampling = SAMPLINGS[sampling_name]
    target, decoder = decoder_for(tokenizer=STRING_TOKENIZER)
    config = None if tree is None else TreeConfig(width=tree[0], depth=tree[1], strategy=tree[2])
    got = enumerate_constrained(decoder, config, sampling, rule, k=4, constraint=STRING_CONSTRAINT)
    want = constrained_joint(target, sampling, 4, (STRING_TOKENIZER, STRING_CONSTRAINT))
    assert max_abs_diff(got, want) < 1e-9
    if not sampling.greedy:  # both spellings happen
        assert any(seq[:2] == (0, 1) for seq in got) and any(seq[:2] == (0, 3) for seq in got)


# ---- chi-square on a tiny real model --------------------------------------------------------
MC_TOKENS = [b"a", b"<eos>", b"b", b"c", b"d", b"ab", b"e", b"f"]  # tiny_llama's EOS is id 1
MC_TOKENIZER = ToyTokenizer(MC_TOKENS, 1)
MC_CONSTRAINT = Regex("(a|b|c)(d|e|ab)[a-f]*")


def mc_mask(tokens: tuple[int, ...]) -> torch.Tensor:
    vocab = GrammarVocabulary.of(MC_TOKENIZER, len(MC_TOKENS), (1,))
    m = llguidance.LLMatcher(vocab.tokenizer, MC_CONSTRAINT.grammar)
    assert m.consume_tokens(list(tokens))
    bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return torch.from_numpy(bits[: len(MC_TOKENS)].astype(bool))


def test_sampled_constrained_output_matches_the_constrained_target(models):  # noqa: F811 (fixture)
    from collections import Counter

    from .mc import PROMPT as MC_PROMPT
    from .mc import K as MC_K
    from .mc import N, chi2_pvalue

    target, draft = models
    sampling = SamplingConfig(temperature=1.0)

    def joint(sampling):
        out: dict[tuple, float] = {(): 1.0}
        for _ in range(MC_K):
            nxt = {}
            for seq, w in out.items():
                with torch.no_grad():
                    logits = target(torch.tensor([MC_PROMPT + list(seq)])).logits[0, -1].double()
                p = probs(logits.masked_fill(~mc_mask(seq), float("-inf")), sampling)
                for x in torch.nonzero(p).flatten().tolist():
                    nxt[seq + (x,)] = w * float(p[x])
            out = nxt
        return out

    dec = SpeculativeDecoder(target, draft, MC_TOKENIZER)
    counts, accepted = Counter(), 0
    for seed in range(N):
        out = dec.generate(
            MC_PROMPT, MC_K, tree=TreeConfig(2, 2), sampling=sampling, seed=seed, ignore_eos=True,
            constraint=MC_CONSTRAINT,
        )  # fmt: skip
        counts[tuple(out.token_ids)] += 1
        accepted += out.sources.count("accepted")
    assert accepted > N // 10
    assert chi2_pvalue(counts, joint(sampling), N) > 1e-3
    assert chi2_pvalue(counts, joint(SamplingConfig(temperature=1.6)), N) < 1e-3  # power


def test_ignore_eos_stops_at_the_grammars_end_plain_or_speculative():
    """Past a complete grammar only EOS may follow: the output ends there, whatever the tree."""
    target, decoder = decoder_for()
    sampling = SAMPLINGS["T1"]

    def run(tree):
        def go(rng):
            out = decoder.generate(
                list(PROMPT), 4, tree=tree, sampling=sampling, rng=rng, constraint=CONSTRAINT, ignore_eos=True
            )
            assert EOS not in out.token_ids[:-1]
            return tuple(out.token_ids)

        return enumerate_outcomes(go)

    plain = run(None)
    assert max_abs_diff(run(TreeConfig(1, 2)), plain) < 1e-9
    assert any(seq[-1] == EOS and len(seq) < 4 for seq in plain)
