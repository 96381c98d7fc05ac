"""Tokenizer compatibility (issue 11, item 3): real tiny tokenizers built in-process, a padded
draft (lossless, by enumeration), real mismatches named by id, custom drafters checked."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from treespec import (
    Drafter,
    DraftTree,
    Draw,
    ProposalGroup,
    SamplingConfig,
    SpeculativeDecoder,
    TokenTree,
    TreeConfig,
)
from treespec.drafters import ModelDrafter, draft_tree
from treespec.rng import TorchRng

from .conftest import tiny_llama
from .toy import TableModel, TableRunner, enumerate_outcomes, max_abs_diff

WORDS = ["<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(87)]  # 90 tokens


def make_tokenizer(words=WORDS, eos="</s>") -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token=eos, unk_token="<unk>")


def small(seed, vocab):
    return tiny_llama(seed, hidden=16, layers=1, heads=2, kv_heads=1, vocab=vocab)


GREEDY = SamplingConfig(temperature=0)


def test_compatible_tokenizers():
    words = WORDS + [f"x{i}" for i in range(6)]  # 96 tokens = the models' rows
    dec = SpeculativeDecoder(
        tiny_llama(0), small(1, 96), tokenizer=make_tokenizer(words), draft_tokenizer=make_tokenizer(words)
    )
    out = dec.generate("w1 w2 w3", 12, tree=TreeConfig(2, 3), sampling=GREEDY, ignore_eos=True)
    assert (
        out.token_ids == dec.generate("w1 w2 w3", 12, tree=None, sampling=GREEDY, ignore_eos=True).token_ids
    )
    assert out.text is not None and dec.draft_support == 96


@pytest.mark.parametrize("draft_rows", [96, 104])
def test_draft_padded_beyond_the_tokenizer(draft_rows):
    """90 real tokens; target 96 rows, draft 96 or 104 (Qwen-style padding): q has no mass on
    ids >= 90 and is as long as the target's rows; greedy output is the target's."""
    tok = make_tokenizer()
    dec = SpeculativeDecoder(
        tiny_llama(0), small(1, draft_rows), tokenizer=tok, draft_tokenizer=make_tokenizer()
    )
    assert dec.draft_support == 90 and dec.vocab_size == 96
    drafter = dec.drafter.make(TreeConfig(3, 2), dec.draft_runner)
    assert isinstance(drafter, ModelDrafter)
    drafter.start([3, 4, 5], SamplingConfig(temperature=1.0), TorchRng(0))
    draft = draft_tree(drafter, [3, 4, 5], 2)
    for g in draft.groups:
        assert g.q.shape == (96,) and float(g.q[90:].sum()) == 0 and abs(float(g.q.sum()) - 1) < 1e-9
    assert max(draft.tree.tokens) < 90
    for tree in (TreeConfig(1, 4), TreeConfig(3, 3, strategy="topk")):
        got = dec.generate("w1 w2 w3", 16, tree=tree, sampling=GREEDY, ignore_eos=True).token_ids
        assert got == dec.generate("w1 w2 w3", 16, tree=None, sampling=GREEDY, ignore_eos=True).token_ids
    out = dec.generate(
        "w1 w2 w3",
        16,
        tree=TreeConfig(2, 3),
        sampling=SamplingConfig(temperature=1.0),
        seed=0,
        ignore_eos=True,
    )
    assert len(out.token_ids) == 16


class Padded:
    """A table model with extra output rows: `fill` logits on ids >= base.vocab_size."""

    def __init__(self, base: TableModel, rows: int, fill: float):
        self.base, self.vocab_size, self.fill = base, rows, fill

    def logits(self, context):
        pad = torch.full((self.vocab_size - self.base.vocab_size,), self.fill, dtype=torch.float64)
        return torch.cat([self.base.logits(context), pad])


class SizedTokenizer:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.mark.parametrize(
    "target_rows,draft_rows,strategy,n",
    [
        (3, 5, "iid", 3),
        (5, 4, "iid", 3),
        (5, 5, "iid", 3),
        (3, 5, "without_replacement", 2),
        (5, 4, "without_replacement", 2),
    ],
)
def test_padding_is_lossless_by_enumeration(target_rows, draft_rows, strategy, n):
    """3 real tokens. The draft's padding rows carry large logits (+2): unmasked, q would put
    most of its mass there. The target's padding rows are -inf (a trained model never emits
    them). The emitted joint equals the target's own, exactly."""
    target = Padded(TableModel(3, seed=11), target_rows, float("-inf"))
    draft = Padded(TableModel(3, seed=12, base=target.base, noise=0.8), draft_rows, 2.0)
    dec = SpeculativeDecoder(TableRunner(target), TableRunner(draft), tokenizer=SizedTokenizer(3))
    sampling = SamplingConfig(temperature=1.0)

    def run(rng):
        out = dec.generate(
            [1, 0], n, tree=TreeConfig(2, 2, strategy=strategy), sampling=sampling, rng=rng, ignore_eos=True
        )
        return tuple(out.token_ids)

    got = enumerate_outcomes(run)
    want = TableModel.joint(target, (1, 0), n, sampling)
    assert abs(sum(got.values()) - 1) < 1e-9 and max_abs_diff(got, want) < 1e-9


def test_swapped_ids_are_named():
    words = list(WORDS)
    words[10], words[11] = words[11], words[10]
    with pytest.raises(
        ValueError,
        match=r"differs from the target's on 2 of 90 shared ids \(target vs draft: 10: 'w7' vs "
        r"'w8', 11: 'w8' vs 'w7'\)",
    ):
        SpeculativeDecoder(
            tiny_llama(0), small(1, 96), tokenizer=make_tokenizer(), draft_tokenizer=make_tokenizer(words)
        )


def test_different_eos_is_refused():
    with pytest.raises(ValueError, match="disagree on eos_token_id: 1 vs 2"):
        SpeculativeDecoder(
            tiny_llama(0),
            small(1, 96),
            tokenizer=make_tokenizer(),
            draft_tokenizer=make_tokenizer(eos="<unk>"),
        )


def test_extra_ids_in_one_tokenizer_only_are_allowed():
    bigger = make_tokenizer(WORDS + ["y0", "y1"])  # 92 tokens: ids 90, 91 exist only in the draft's
    dec = SpeculativeDecoder(tiny_llama(0), small(1, 96), tokenizer=make_tokenizer(), draft_tokenizer=bigger)
    assert dec.draft_support == 90  # the draft is kept off ids the target's tokenizer does not know


def test_draft_with_fewer_rows_than_the_tokenizer_is_refused():
    with pytest.raises(
        ValueError, match="the draft model has 64 output rows but the tokenizer has 90 tokens"
    ):
        SpeculativeDecoder(tiny_llama(0), small(1, 64), tokenizer=make_tokenizer())


def test_different_rows_without_a_tokenizer_are_refused():
    with pytest.raises(ValueError, match="vocabularies differ .* pass tokenizer="):
        SpeculativeDecoder(tiny_llama(0), small(1, 100))


class BadDrafter(Drafter):
    def __init__(self, token=3, q_size=None, root=None):
        self.token, self.q_size, self.root = token, q_size, root

    def start(self, prompt, sampling, rng):
        pass

    def propose(self, context, depth):
        root = context[-1] if self.root is None else self.root
        tree = TokenTree([root, self.token], [-1, 0])
        if self.q_size is None:
            return DraftTree(tree, (ProposalGroup(0, Draw.DETERMINISTIC, (self.token,), (1,)),))
        q = torch.zeros(self.q_size, dtype=torch.float64)
        q[self.token] = 1
        return DraftTree(tree, (ProposalGroup(0, Draw.IID, (self.token,), (1,), q),))


@pytest.mark.parametrize(
    "drafter,match",
    [
        (
            BadDrafter(token=500),
            r"BadDrafter proposed token ids \[500\] outside the target's vocabulary \[0, 96\)",
        ),
        (
            BadDrafter(q_size=100),
            "BadDrafter proposed from a q over 100 tokens, but the target's vocabulary has 96",
        ),
        (BadDrafter(root=7), "not at the last committed token"),
    ],
)
def test_custom_drafters_are_checked(drafter, match):
    dec = SpeculativeDecoder(tiny_llama(0), drafter=drafter)
    with pytest.raises(ValueError, match=match):
        dec.generate([3, 4, 5], 8, tree=TreeConfig(1, 1), sampling=SamplingConfig(temperature=1.0), seed=0)


def test_a_pair_loads_one_tokenizer_and_generic_ones_skip_autotokenizer(monkeypatch):
    """A draft holding its target's tokenizer files shares the target's tokenizer (one load),
    a feature head has none to load, and a tokenizer.json of the generic class is the object
    AutoTokenizer gives, loaded without reading the model's config (issue 39: start-up)."""
    from transformers import AutoTokenizer

    from treespec.backends import hf
    from treespec.zoo import ZOO

    calls = []
    real = hf.load_tokenizer
    monkeypatch.setattr(hf, "load_tokenizer", lambda path: calls.append(path) or real(path))
    dec = SpeculativeDecoder.from_pretrained(target=ZOO / "pycode" / "target", draft=ZOO / "pycode" / "draft")
    assert len(calls) == 1 and dec.tokenizer is not None
    monkeypatch.undo()
    path = ZOO / "pycode" / "target"
    ours, theirs = hf.load_tokenizer(path), AutoTokenizer.from_pretrained(str(path))
    text = "def f(x):\n    return [x ** 2 for x in range(10)]  # é\n"
    assert type(ours) is type(theirs) and ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert ours.decode(theirs(text)["input_ids"]) == theirs.decode(theirs(text)["input_ids"])
    assert (ours.eos_token_id, ours.bos_token_id) == (theirs.eos_token_id, theirs.bos_token_id)
