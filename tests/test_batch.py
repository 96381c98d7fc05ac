"""Batched decoding: every request of a batch gets exactly what it would get alone.

`generate_batch()` and `SpeculativeDecoder.engine()` run many requests through one loop, one
target forward per round for all of them. Nothing a request computes may depend on the
others: its draws come from its own seeded generator in the same order as alone, and its
forwards see only its own cache row. float64 tiny models, so that a packed forward and a
lone forward cannot disagree on a coin or an argmax through rounding.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.backends.base import extend_many, prefill_many, score_many
from treespec.backends.hf import HFRunner
from treespec.backends.native import NativeRunner
from treespec.planning import GoodputSwitch, policy
from treespec.prefill import DEFAULT_ROUND_TOKENS
from treespec.tree import TokenTree

from .conftest import VOCAB, perturbed, tiny_llama
from .llamas import assert_cache_equals_prefill
from .mc import PROMPT as MC_PROMPT
from .mc import K as MC_K
from .mc import V as MC_V
from .mc import chi2_pvalue, exact_joint
from .toy import PROMPT as TOY_PROMPT
from .toy import SAMPLINGS as TOY_SAMPLINGS
from .toy import TableRunner, enumerate_outcomes, max_abs_diff
from .toy import pair as toy_pair

GREEDY = SamplingConfig(temperature=0)
T1 = SamplingConfig(temperature=1.0)
T07 = SamplingConfig(temperature=0.7, top_p=0.9)
# ragged prompt lengths, 1 to 23 tokens
PROMPTS = [[(5 * i + 3 * j) % (VOCAB - 2) + 2 for j in range(1 + (i * 7) % 23)] for i in range(8)]
# (tree, sampling, max_new_tokens, seed): mixed trees, sampling configs and lengths
REQUESTS = [
    (TreeConfig(1, 4), GREEDY, 20, 0),
    (TreeConfig(2, 3), T1, 13, 1),
    (None, T07, 9, 2),
    (TreeConfig(3, 3, "without_replacement"), T07, 24, 3),
    (TreeConfig(2, 4, "topk"), GREEDY, 5, 4),
    (TreeConfig(2, 2, adaptive="hf", depth_min=1, depth_max=5), T1, 17, 5),
    (TreeConfig(1, 6), T1, 30, 6),
    (
        TreeConfig(2, 3),
        SamplingConfig(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.2),
        16,
        7,
    ),  # per-path context
]


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0)
    return target, perturbed(target, noise=0.3, seed=1)


def alone(dec: SpeculativeDecoder, i: int, **extra):
    tree, sampling, n, seed = REQUESTS[i]
    return dec.generate(PROMPTS[i], n, tree=tree, sampling=sampling, seed=seed, **extra)


def assert_same(got, want) -> None:
    assert got.token_ids == want.token_ids
    assert got.sources == want.sources
    assert got.finish_reason == want.finish_reason
    assert got.verification == want.verification
    for name in (
        "target_steps",
        "tokens",
        "tree_nodes",
        "accepted_by_depth",
        "attempted_by_depth",
        "draft_forwards",
    ):
        assert getattr(got.stats, name) == getattr(want.stats, name), name


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("max_batch", [16, 3])
def test_each_request_of_a_batch_equals_it_alone(models, backend, max_batch):
    """Mixed prompt lengths, trees (incl. plain decoding), greedy and sampled configs, and
    lengths that finish requests at different rounds; with max_batch=3 requests also wait
    for lanes and join a running batch."""
    dec = SpeculativeDecoder(*models, backend=backend)
    want = [alone(dec, i) for i in range(len(REQUESTS))]
    trees, samplings, lengths, seeds = (list(x) for x in zip(*REQUESTS))
    got = dec.generate_batch(
        PROMPTS,
        max_new_tokens=lengths,
        tree=trees,
        sampling=samplings,
        seeds=seeds,
        max_batch=max_batch,
        trace=True,
    )
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w)
        # every round of a batched request is the round it has alone
        traced = alone(dec, i, trace=True).trace
        assert [(t.path, t.token, t.emitted) for t in g.trace] == [
            (t.path, t.token, t.emitted) for t in traced
        ]
    assert len({len(w.token_ids) for w in want}) > 3  # the requests really finished at different rounds


def test_one_target_forward_per_round_for_all_requests(models, monkeypatch):
    """Native lanes share one packed forward: the target model runs once per round (plus one
    prefill), not once per request, and the draft once per depth."""
    calls = []
    packed = NativeRunner._packed_forward

    def counting(self, lanes, feeds, need_logits):
        calls.append((id(self.pool), len(lanes), [f.tokens.shape[0] for f in feeds], need_logits))
        return packed(self, lanes, feeds, need_logits)

    monkeypatch.setattr(NativeRunner, "_packed_forward", counting)
    dec = SpeculativeDecoder(*models, backend="native")
    tree = TreeConfig(2, 3)
    outs = dec.generate_batch(
        PROMPTS[:4], max_new_tokens=12, tree=tree, sampling=T1, seeds=[0, 1, 2, 3], ignore_eos=True
    )
    target_pool = id(dec._lanes(4)[0][0].pool)
    target_calls = [c for c in calls if c[0] == target_pool]
    rounds = max(o.stats.target_steps for o in outs)
    # the prompts load in pieces of DEFAULT_ROUND_TOKENS, all four in one forward a step; a
    # request whose prompt is whole decodes from that step on, one forward a round for all
    pieces = -(-sum(len(p) - 1 for p in PROMPTS[:4]) // DEFAULT_ROUND_TOKENS)
    assert sum(not logits for *_, logits in target_calls) == pieces
    assert rounds <= sum(logits for *_, logits in target_calls) <= rounds + pieces - 1
    assert max(n for _, n, _, _ in target_calls) == 4  # the four requests' trees in one forward
    draft_calls = [c for c in calls if c[0] != target_pool]
    assert max(n for _, n, _, _ in draft_calls) == 4
    assert len(draft_calls) <= pieces + (rounds + pieces) * (tree.depth + 1)  # (catch-up +) one per depth


def test_hf_lanes_share_one_batched_forward(models):
    """HF lanes too: one model call per round for all requests (their caches copied into one
    padded batch), not one per request."""
    target, draft = models
    calls = {"target": [], "draft": []}
    hooks = [
        m.register_forward_pre_hook(
            lambda mod, args, kw, name=name: calls[name].append(tuple(kw["input_ids"].shape)),
            with_kwargs=True,
        )
        for name, m in (("target", target), ("draft", draft))
    ]
    try:
        dec = SpeculativeDecoder(target, draft, backend="hf")
        tree = TreeConfig(2, 3)
        outs = dec.generate_batch(
            PROMPTS[:4], max_new_tokens=12, tree=tree, sampling=T1, seeds=[0, 1, 2, 3], ignore_eos=True
        )
    finally:
        for h in hooks:
            h.remove()
    rounds = max(o.stats.target_steps for o in outs)
    # the prompts load in pieces (every prompt but its last token, fed with the first tree):
    # the first step's piece holds the shortest prompts whole, ragged, padded
    pieces = -(-sum(len(p) - 1 for p in PROMPTS[:4]) // DEFAULT_ROUND_TOKENS)
    assert rounds + pieces <= len(calls["target"]) <= rounds + 2 * pieces - 1
    assert calls["target"][0][0] == sum(len(p) > 1 for p in PROMPTS[:4])
    assert max(b for b, _ in calls["target"]) == 4 and max(b for b, _ in calls["draft"]) == 4
    assert len(calls["draft"]) <= 1 + rounds * (tree.depth + 1)


def tiny_gpt2() -> torch.nn.Module:
    """A non-Llama family for the HF backend: absolute position embeddings, MHA."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=256,
        bos_token_id=0,
        eos_token_id=1,
        attn_implementation="sdpa",
    )
    return GPT2LMHeadModel(config).double().eval()


def test_gpt2_batch_equals_each_request_alone():
    """A family only the HF backend serves, end to end: every request of a batch (mixed
    trees, samplings, lengths) gets exactly what it gets alone through generate()."""
    target = tiny_gpt2()
    dec = SpeculativeDecoder(target, perturbed(target, noise=0.3, seed=1))
    assert type(dec.target_runner).__name__ == "HFRunner"
    want = [alone(dec, i) for i in range(len(REQUESTS))]
    trees, samplings, lengths, seeds = (list(x) for x in zip(*REQUESTS))
    got = dec.generate_batch(PROMPTS, max_new_tokens=lengths, tree=trees, sampling=samplings, seeds=seeds)
    for g, w in zip(got, want):
        assert_same(g, w)


@pytest.mark.parametrize("family", ["llama-sdpa", "llama-eager", "gpt2"])
def test_hf_batched_forward_equals_lone_forwards(family):
    """The padded batch of HF lanes (ragged caches, one lane still empty, trees of different
    sizes, chains) gives each lane the logits and the cache its lone runner gets."""
    model = tiny_gpt2() if family == "gpt2" else tiny_llama(0, attn=family.split("-")[1])
    tol = 1e-6 if family == "llama-eager" else 1e-9  # HF's eager softmax runs in float32
    lanes, alone_ = HFRunner(model).lanes(3), [HFRunner(model) for _ in range(3)]
    prefill_many([(lane, PROMPTS[i]) for i, lane in enumerate(lanes) if i != 2])  # lane 2 starts empty
    for i in (0, 1):
        alone_[i].prefill(PROMPTS[i])
    rng = torch.Generator().manual_seed(0)
    for rnd in range(4):
        trees = []
        for b in range(3):
            size = 1 + (b * 3 + rnd) % 6
            parents = [-1] + [int(torch.randint(0, i, (1,), generator=rng)) for i in range(1, size)]
            trees.append(TokenTree(torch.randint(2, VOCAB, (size,), generator=rng).tolist(), parents))
        got = score_many(list(zip(lanes, trees)))
        for b in range(3):
            assert (got[b].logits - alone_[b].score(trees[b])).abs().max() < tol
            chain = trees[b].path_to(len(trees[b]) - 1)[: 1 + rnd % 3]
            lanes[b].commit(chain)
            alone_[b].commit(chain)
        steps = [[int(t)] for t in torch.randint(2, VOCAB, (3,), generator=rng)]  # a chain step each
        for b, scores in enumerate(extend_many([(lane, step, [-1]) for lane, step in zip(lanes, steps)])):
            assert (scores.logits - alone_[b].extend(steps[b], [-1])).abs().max() < tol
            lanes[b].commit([0])
            alone_[b].commit([0])
    for lane, lone in zip(lanes, alone_):
        assert lane.committed == lone.committed
        for a, b in zip(lane.cache.layers, lone.cache.layers):
            assert a.keys.shape == b.keys.shape and (a.keys - b.keys).abs().max() < tol


def test_hf_lanes_with_sliding_window_caches_run_one_forward_each():
    """Cache layers the padded batch does not handle (here Mistral's sliding-window layers)
    fall back to one forward per lane, with the same answers."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=64,
        attn_implementation="sdpa",
    )
    model = MistralForCausalLM(config).double().eval()
    lanes, alone_ = HFRunner(model).lanes(2), [HFRunner(model) for _ in range(2)]
    assert not any(lane.plain_cache() for lane in lanes)
    calls = []
    hook = model.register_forward_pre_hook(
        lambda mod, args, kw: calls.append(kw["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        prefill_many([(lane, PROMPTS[i + 1]) for i, lane in enumerate(lanes)])
        trees = [TokenTree([3, 4, 5], [-1, 0, 0]), TokenTree([6, 7], [-1, 0])]
        got = score_many(list(zip(lanes, trees)))
    finally:
        hook.remove()
    assert calls == [1, 1, 1, 1]  # two prefills, two tree forwards: one lane each
    for b in range(2):
        alone_[b].prefill(PROMPTS[b + 1])
        assert (got[b].logits - alone_[b].score(trees[b])).abs().max() < 1e-9


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_engine_add_step_stream_cancel(models, backend):
    """Continuous batching: requests join between rounds, stream, and one is cancelled
    mid-flight; the others are untouched and the caches of every lane stay exact."""
    target, draft = models
    dec = SpeculativeDecoder(target, draft, backend=backend)
    eng = dec.engine(max_live=2)
    streamed: dict[int, list[int]] = {0: [], 1: [], 3: []}
    ids = {}
    for i in (0, 1, 3):
        tree, sampling, n, seed = REQUESTS[i]
        ids[i] = eng.add(
            PROMPTS[i],
            max_new_tokens=n,
            tree=tree,
            sampling=sampling,
            seed=seed,
            on_tokens=lambda toks, src, i=i: streamed[i].extend(toks),
        )
    eng.step()
    assert [eng.requests[ids[i]].status for i in (0, 1, 3)] == ["live", "live", "waiting"]
    eng.step()
    # every lane's cache equals a fresh prefill of what it committed, mid-batch
    for lane in eng.targets:
        assert_cache_equals_prefill(lane, target)
    part = eng.cancel(ids[1])
    assert part.finish_reason == "cancelled"
    full = alone(dec, 1)
    assert part.token_ids == full.token_ids[: len(part.token_ids)] and part.token_ids
    late = eng.add(
        PROMPTS[4],
        max_new_tokens=REQUESTS[4][2],
        tree=REQUESTS[4][0],
        sampling=REQUESTS[4][1],
        seed=REQUESTS[4][3],
    )
    outs = eng.run()
    for i in (0, 3):
        assert_same(outs[ids[i]], alone(dec, i))
        assert streamed[i] == outs[ids[i]].token_ids
    assert_same(outs[late], alone(dec, 4))
    assert outs[ids[1]] is part


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_caches_after_many_rounds_equal_fresh_prefills(models, backend):
    target, draft = models
    dec = SpeculativeDecoder(target, draft, backend=backend)
    eng = dec.engine(max_live=3)
    trees = [TreeConfig(2, 3), TreeConfig(3, 2, "without_replacement"), TreeConfig(1, 5)]
    for i, tree in enumerate(trees):
        eng.add(PROMPTS[i + 1], max_new_tokens=200, tree=tree, sampling=T1, seed=i, ignore_eos=True)
    for _ in range(25):
        eng.step()
    for lane in eng.targets:
        assert lane.n_committed > len(PROMPTS[3]) + 25
        assert_cache_equals_prefill(lane, target)
    for lane in eng.drafts:
        assert_cache_equals_prefill(lane, draft)


def test_batch_of_two_toy_requests_is_lossless_by_enumeration():
    """Two requests in one engine, every draw and coin of both enumerated (their choices
    interleave round by round): the joint of their outputs is the product of the target's
    joints, for different trees and sampling configs."""
    a = (TOY_PROMPT, TreeConfig(2, 2), TOY_SAMPLINGS["T1"], 2)
    b = ((0, 2, 1), TreeConfig(2, 1, "without_replacement"), TOY_SAMPLINGS["T0.6-topk2"], 2)
    assert_two_toy_requests_lossless(a, b)


def assert_two_toy_requests_lossless(a, b, switch=None, **engine_settings) -> None:
    """Requests a and b = (prompt, tree, sampling, max_new_tokens) in one engine, every draw
    and coin enumerated: their joint output distribution == the product of the target's.
    `switch`: makes the engine's speculate-or-not switch for each run."""
    target, draft = toy_pair()
    dec = SpeculativeDecoder(TableRunner(target), TableRunner(draft))

    def run(rng):
        eng = dec.engine(max_live=2, **engine_settings)
        if switch is not None:
            eng.switch = switch()
        ids = [eng.add(list(p), n, tree=t, sampling=s, rng=rng, ignore_eos=True) for p, t, s, n in (a, b)]
        outs = eng.run()
        return tuple(tuple(outs[i].token_ids) for i in ids)

    got = enumerate_outcomes(run)
    ja, jb = (target.joint(tuple(p), n, s) for p, _, s, n in (a, b))
    want = {(x, y): pa * pb for x, pa in ja.items() for y, pb in jb.items()}
    assert abs(sum(got.values()) - 1) < 1e-9
    assert max_abs_diff(got, want) < 1e-9


def test_plain_rounds_above_speculate_max_live_stay_lossless_by_enumeration():
    """speculate_max_live=1: while both requests are live every round is plain; once the short
    one finishes, the long one speculates. Every draw and coin enumerated: the joint is still
    the product of the target's joints, across the switch."""
    a = (TOY_PROMPT, TreeConfig(2, 2), TOY_SAMPLINGS["T1"], 1)
    b = ((0, 2, 1), TreeConfig(2, 2), TOY_SAMPLINGS["T0.6-topk2"], 3)
    assert_two_toy_requests_lossless(a, b, speculate_max_live=1)


def test_speculate_max_live_switches_rounds_to_plain(models):
    """Above the limit a round's tree is its root (no draft forward); below it the requests
    speculate again. Greedy outputs stay those of generate() alone."""
    dec = SpeculativeDecoder(*models, backend="native")
    short, long_ = (PROMPTS[1], 3), (PROMPTS[2], 24)
    outs = dec.generate_batch(
        [short[0], long_[0]],
        [short[1], long_[1]],
        tree=TreeConfig(1, 4),
        sampling=GREEDY,
        ignore_eos=True,
        trace=True,
        speculate_max_live=1,
    )
    for out, (prompt, n) in zip(outs, (short, long_)):
        assert (
            out.token_ids
            == dec.generate(prompt, n, tree=TreeConfig(1, 4), sampling=GREEDY, ignore_eos=True).token_ids
        )
    assert all(len(r.tree) == 1 for r in outs[0].trace)  # two live: plain rounds only
    assert outs[0].stats.draft_forwards == 0
    rounds = outs[1].trace
    assert all(len(r.tree) == 1 for r in rounds[:3]) and any(len(r.tree) > 1 for r in rounds[3:])
    assert outs[1].stats.draft_forwards > 0
    for bad in (0, "always", 1.5):
        with pytest.raises(ValueError, match="speculate_max_live must be None, an integer >= 1 or 'auto'"):
            dec.engine(speculate_max_live=bad)


def test_trees_over_shared_tree_nodes_decode_plainly_while_shared_lossless_by_enumeration():
    """shared_tree_nodes=2: while both requests are live, the 2x2 tree (4 nodes) decodes
    plainly and the 2x1 one (2 nodes) drafts; alone again, each drafts its whole tree. Every
    draw and coin enumerated: the joint is the product of the target's joints."""
    a = (TOY_PROMPT, TreeConfig(2, 1), TOY_SAMPLINGS["T1"], 1)
    b = ((0, 2, 1), TreeConfig(2, 2), TOY_SAMPLINGS["T0.6-topk2"], 3)
    assert_two_toy_requests_lossless(a, b, shared_tree_nodes=2)


def test_a_large_tree_decodes_plainly_only_while_others_are_live(models):
    """The server's fairness: a 24-node tree decodes plainly while another request is live and
    drafts its whole tree once alone; the 4-node chain beside it keeps its tree. Greedy outputs
    stay those of generate() alone."""
    dec = SpeculativeDecoder(*models, backend="native")
    eng = dec.engine(max_live=2, shared_tree_nodes=4)
    trees = [TreeConfig(8, 3, "topk"), TreeConfig(1, 4)]
    lengths = [24, 6]
    ids = [
        eng.add(PROMPTS[i + 1], n, tree=t, sampling=GREEDY, ignore_eos=True, trace=True)
        for i, (t, n) in enumerate(zip(trees, lengths))
    ]
    outs = eng.run()
    for i, (t, n) in enumerate(zip(trees, lengths)):
        alone = dec.generate(PROMPTS[i + 1], n, tree=t, sampling=GREEDY, ignore_eos=True)
        assert outs[ids[i]].token_ids == alone.token_ids
    small = outs[ids[1]].trace
    shared = len(small)  # the rounds both were live
    assert all(len(r.tree) > 1 for r in small[:-1])  # within the cap: the chain drafts as asked
    big = outs[ids[0]].trace
    assert all(len(r.tree) == 1 for r in big[:shared])  # over it: plain while shared
    assert any(len(r.tree) > 8 for r in big[shared:])  # alone: the whole tree
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="shared_tree_nodes must be None or an integer >= 0"):
            dec.engine(shared_tree_nodes=bad)
    with pytest.raises(ValueError, match="deterministic=True needs shared_tree_nodes=None"):
        dec.engine(shared_tree_nodes=4, deterministic=True)


class _OddTokensSwitch(GoodputSwitch):
    """Speculates after a round that emitted an odd number of tokens (and first): a switch
    whose every decision depends on the sampled outcomes so far, as a measured one does."""

    def __init__(self):
        super().__init__()
        self.last = 1

    def speculate(self, live: int) -> bool:
        return self.last % 2 == 1

    def record(self, live: int, speculative: bool, tokens: int, seconds: float) -> None:
        self.last = tokens


def test_outcome_dependent_switching_stays_lossless_by_enumeration():
    """Whether a round drafts may depend on everything committed so far (GoodputSwitch's
    timings and token counts do): every draw and coin enumerated, the joint is still the
    product of the target's joints."""
    a = (TOY_PROMPT, TreeConfig(2, 2), TOY_SAMPLINGS["T1"], 2)
    b = ((0, 2, 1), TreeConfig(2, 2), TOY_SAMPLINGS["T0.6-topk2"], 3)
    assert_two_toy_requests_lossless(a, b, switch=_OddTokensSwitch, speculate_max_live="auto")


def test_per_request_goodput_switching_stays_lossless_by_enumeration(monkeypatch):
    """TreeConfig(plain_fallback=True): each request's own switch decides, round by round and
    from that request's outcomes so far, whether it drafts; every draw and coin enumerated,
    the joint is still the product of the target's joints."""
    monkeypatch.setattr(policy, "GoodputSwitch", _OddTokensSwitch)
    a = (TOY_PROMPT, TreeConfig(2, 2, plain_fallback=True), TOY_SAMPLINGS["T1"], 2)
    b = (
        (0, 2, 1),
        TreeConfig(2, 2, plain_fallback=True),
        TOY_SAMPLINGS["T0.6-topk2"],
        3,
    )
    assert_two_toy_requests_lossless(a, b)


def test_per_request_goodput_tries_both_kinds_then_keeps_the_faster(models, monkeypatch):
    """plain_fallback=True: a request speculates for a run, decodes plainly for a run, then
    keeps whichever gave it more tokens per (here: fake) second; two requests of one batch
    decide apart (one fast when speculating, one slow); greedy outputs are generate()'s."""
    trees = {1: TreeConfig(1, 3, plain_fallback=True), 2: TreeConfig(1, 2, plain_fallback=True)}
    seconds = {3: {False: 1.0, True: 1.0}, 2: {False: 1.0, True: 50.0}}  # by depth: a round's fake seconds
    kinds = {3: [], 2: []}  # by depth: each round's decision, speculative or not
    record, next_depth = policy.DepthPolicy.record, policy.DepthPolicy.next_depth

    def fake_record(policy, speculative, tokens, _):
        record(policy, speculative, tokens, seconds[policy.config.depth][speculative])

    def logged(policy):
        depth = next_depth(policy)
        kinds[policy.config.depth].append(depth > 0)
        return depth

    monkeypatch.setattr(policy.DepthPolicy, "record", fake_record)
    monkeypatch.setattr(policy.DepthPolicy, "next_depth", logged)
    dec = SpeculativeDecoder(*models, backend="native")
    eng = dec.engine(max_live=2)
    ids = {i: eng.add(PROMPTS[i], 60, tree=trees[i], sampling=GREEDY, ignore_eos=True) for i in trees}
    outs = eng.run()
    for i, faster in ((1, True), (2, False)):
        got = kinds[trees[i].depth]
        assert got[:16] == [True] * 8 + [False] * 8  # warm-up: a speculative run, then a plain one
        assert len(got) > 24 and got[16:24] == [faster] * 8, (i, got)
        fixed = TreeConfig(1, trees[i].depth)
        want = dec.generate(PROMPTS[i], 60, tree=fixed, sampling=GREEDY, ignore_eos=True)
        assert outs[ids[i]].token_ids == want.token_ids


def test_goodput_switch_runs_explores_follows_drift_and_buckets_live_counts():
    def decide(sw, n, live=8, spec_seconds=2.5):  # speculative round: 3 tokens per request; plain: 1, in 1 s
        got = []
        for _ in range(n):
            got.append(sw.speculate(live))
            sw.record(
                live, got[-1], tokens=3 * live if got[-1] else live, seconds=spec_seconds if got[-1] else 1.0
            )
        return got

    sw = GoodputSwitch(run_rounds=2, explore_every=3, decay=0.5)
    decisions = decide(sw, 16)
    assert sw.speedup(8) == pytest.approx(1.2)
    # runs of 2 rounds: warm-up (speculative, plain), then speculative but for every 3rd run, which explores
    assert decisions == [
        True,
        True,
        False,
        False,
        True,
        True,
        True,
        True,
        False,
        False,
        True,
        True,
        True,
        True,
        False,
        False,
    ]
    wide = GoodputSwitch(run_rounds=2, explore_every=3, decay=0.5)
    decisions = decide(wide, 28, spec_seconds=1.5)  # 2x faster: explores every 12th run only
    assert wide.speedup(8) == pytest.approx(2) and [i for i, k in enumerate(decisions) if not k] == [
        2,
        3,
        26,
        27,
    ]
    for _ in range(3):  # plain rounds get 4x faster (say, the batch became compute-bound): the sums follow
        sw.record(8, False, tokens=8, seconds=0.25)
    assert sw.speedup(7) < 1 and not sw.speculate(7)  # 5-8 live share a bucket; a new run begins
    assert sw.speedup(4) is None and sw.speculate(4)  # 3-4 live: a fresh bucket, warming up speculative first
    assert [sw.bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [0, 1, 2, 2, 3, 3, 4]


def test_auto_switch_tries_both_kinds_then_keeps_the_faster(models):
    """speculate_max_live="auto": at each live count both kinds of round are tried, then the
    one with more tokens per (here: fake) second runs; greedy outputs stay those of
    generate() alone whichever ran."""
    for plain_seconds, spec_seconds, faster in ((1.0, 1.0, "speculative"), (1.0, 50.0, "plain")):
        dec = SpeculativeDecoder(*models, backend="native")
        eng = dec.engine(max_live=2, speculate_max_live="auto")
        kinds = []  # (live requests, speculative) of every decision
        clock, calls = [0.0], [0]

        def tick():  # called at the start and at the end of each round: a round takes its kind's seconds
            calls[0] += 1
            if calls[0] % 2 == 0:
                clock[0] += spec_seconds if kinds[-1][1] else plain_seconds
            return clock[0]

        eng.switch.clock = tick
        decide = eng.switch.speculate
        eng.switch.speculate = lambda live: kinds.append((live, decide(live))) or kinds[-1][1]
        ids = [
            eng.add(PROMPTS[i], 40, tree=TreeConfig(1, 3), sampling=GREEDY, ignore_eos=True) for i in (1, 2)
        ]
        outs = eng.run()
        for i, rid in zip((1, 2), ids):
            assert (
                outs[rid].token_ids
                == dec.generate(
                    PROMPTS[i], 40, tree=TreeConfig(1, 3), sampling=GREEDY, ignore_eos=True
                ).token_ids
            )
        two_live = [k for live, k in kinds if live == 2]
        assert two_live[:16] == [True] * 8 + [False] * 8  # warm-up: a speculative run, then a plain one
        after = two_live[16:22]
        assert len(after) == 6 and after == [faster == "speculative"] * 6, (faster, kinds)
        assert dec.engine(speculate_max_live="auto").switch is eng.switch  # what it measured carries over


def test_each_request_of_a_batch_matches_the_target_chi_square():
    """Many seeded requests in batches of 16, two settings interleaved: each setting's
    K-grams fit the target's exact joint (and clearly not another temperature's)."""
    target = tiny_llama(3, hidden=32, vocab=MC_V)
    dec = SpeculativeDecoder(target, perturbed(target, noise=0.5, seed=4), backend="native")
    settings = [
        (TreeConfig(3, 2), SamplingConfig(temperature=0.9, top_p=0.9)),
        (TreeConfig(1, 2), SamplingConfig(temperature=1.2, top_k=5)),
    ]
    n = 600
    outs = dec.generate_batch(
        [MC_PROMPT] * (2 * n),
        max_new_tokens=MC_K,
        tree=[settings[i % 2][0] for i in range(2 * n)],
        sampling=[settings[i % 2][1] for i in range(2 * n)],
        seeds=list(range(2 * n)),
        ignore_eos=True,
    )
    for k, (_, sampling) in enumerate(settings):
        mine = outs[k::2]
        counts = Counter(tuple(o.token_ids) for o in mine)
        assert sum(o.sources.count("accepted") for o in mine) > n // 10  # the drafts were used
        assert chi2_pvalue(counts, exact_joint(target, sampling), n) > 1e-3
        other = SamplingConfig(
            temperature=sampling.temperature * 1.6, top_k=sampling.top_k, top_p=sampling.top_p
        )
        assert chi2_pvalue(counts, exact_joint(target, other), n) < 1e-3


def test_depth_shrinks_near_the_model_limit(models):
    """A request that runs up to the model's last position finishes with a deep tree instead
    of failing; its batch neighbour is unaffected."""
    target, draft = models
    dec = SpeculativeDecoder(target, draft)
    limit = target.config.max_position_embeddings
    long_prompt = [(3 * j) % (VOCAB - 2) + 2 for j in range(limit - 10)]
    outs = dec.generate_batch(
        [long_prompt, PROMPTS[2]],
        max_new_tokens=[10, 20],
        tree=TreeConfig(2, 8),
        sampling=T1,
        seeds=[0, 1],
        ignore_eos=True,
    )
    assert [len(o.token_ids) for o in outs] == [10, 20]
    assert_same(
        outs[1], dec.generate(PROMPTS[2], 20, tree=TreeConfig(2, 8), sampling=T1, seed=1, ignore_eos=True)
    )


def test_kv_budget_makes_requests_wait_not_fail(models):
    dec = SpeculativeDecoder(*models)
    tree, sampling = TreeConfig(2, 3), T1
    need = len(PROMPTS[5]) + 20 + tree.max_depth
    eng = dec.engine(max_live=4, max_kv_tokens=need + 5)  # room for one request at a time
    ids = [eng.add(PROMPTS[5], max_new_tokens=20, tree=tree, sampling=sampling, seed=s) for s in range(3)]
    eng.step()
    assert len(eng.live) == 1 and len(eng.waiting) == 2 and eng.kv_tokens == need
    status = eng.status()  # what a front end reads (the server's metrics and queue limit)
    assert (status.live, status.waiting, status.kv_tokens) == ((ids[0],), 2, need)
    assert (status.max_live, status.max_kv_tokens) == (4, need + 5)
    outs = eng.run()
    for s, i in enumerate(ids):
        assert_same(outs[i], dec.generate(PROMPTS[5], 20, tree=tree, sampling=sampling, seed=s))
    with pytest.raises(ValueError, match="max_kv_tokens"):
        eng.add(PROMPTS[5], max_new_tokens=40, tree=tree)


BAD_BATCHES = [
    (dict(prompts=[]), "empty list"),
    (dict(prompts="def f():"), "list of prompts"),
    (dict(prompts=[[2, 3], [4]], seeds=[1]), "seeds has 1 entries for 2 prompts"),
    (dict(prompts=[[2, 3], [4]], tree=[TreeConfig(1, 2)] * 3), "tree has 3 entries for 2 prompts"),
    (dict(prompts=[[2, 3], [4]], max_new_tokens=[5]), "max_new_tokens has 1 entries"),
    (dict(prompts=[[2, 3], [4]], sampling=[T1]), "sampling has 1 entries"),
    (dict(prompts=[[2, 3], [], [4]]), "request 1: the prompt is empty"),
    (dict(prompts=[[2, 3], [4, VOCAB + 5]]), r"request 1: prompt token ids \[101\]"),
    (dict(prompts=[[2, 3], [4]], seeds=[0, -1]), r"request 1: seed must be"),
    (dict(prompts=[[2, 3], [4]], max_new_tokens=[4, 10_000]), "request 1: prompt .* exceeds"),
    (dict(prompts=[[2, 3], [4]], max_batch=0), "max_batch must be an integer >= 1"),
    (dict(prompts=[[2, 3], [4]], seeds=7), "seeds must be a list"),
]


@pytest.mark.parametrize("kwargs,message", BAD_BATCHES, ids=[m for _, m in BAD_BATCHES])
def test_bad_batches_are_clear_errors_before_any_work(models, kwargs, message, monkeypatch):
    dec = SpeculativeDecoder(*models)
    ran = []
    monkeypatch.setattr(NativeRunner, "_packed_forward", lambda *a, **k: ran.append(1))
    with pytest.raises(ValueError, match=message):
        dec.generate_batch(**kwargs)
    assert not ran  # nothing ran before the error


def test_a_bad_request_added_to_a_running_engine_loses_nothing(models):
    dec = SpeculativeDecoder(*models)
    eng = dec.engine(max_live=2)
    good = eng.add(PROMPTS[1], max_new_tokens=13, tree=REQUESTS[1][0], sampling=T1, seed=1)
    eng.step()
    with pytest.raises(ValueError, match="the prompt is empty"):
        eng.add([], max_new_tokens=5)
    with pytest.raises(ValueError, match="no request with id"):
        eng.cancel(99)
    assert_same(eng.run()[good], alone(dec, 1))


def test_a_drafter_instance_cannot_serve_a_batch(models):
    from treespec.drafters import NgramDrafter

    dec = SpeculativeDecoder(models[0], drafter=NgramDrafter(2))
    with pytest.raises(ValueError, match="holds one sequence's state"):
        dec.generate_batch([[2, 3], [4, 5]], tree=TreeConfig(2, 2))
    assert (
        len(dec.generate_batch([[2, 3], [4, 5]], max_new_tokens=4, tree=TreeConfig(2, 2), max_batch=1)) == 2
    )


def test_stops_and_streaming_per_request(models):
    """Each request has its own stop list (ids here; strings go through the same matcher)
    and its own streaming callback; a stopped request leaves the batch, the others go on."""
    dec = SpeculativeDecoder(*models)
    free = [
        dec.generate(PROMPTS[i], 20, tree=TreeConfig(2, 3), sampling=T1, seed=i, ignore_eos=True)
        for i in range(3)
    ]
    stop_at = free[0].token_ids[6]  # request 0 stops at its 7th token (or earlier, at the first occurrence)
    stops = [[stop_at], None, [VOCAB - 1, VOCAB - 2]]
    want = [
        dec.generate(
            PROMPTS[i], 20, tree=TreeConfig(2, 3), sampling=T1, seed=i, ignore_eos=True, stop=stops[i]
        )
        for i in range(3)
    ]
    got = dec.generate_batch(
        PROMPTS[:3], 20, tree=TreeConfig(2, 3), sampling=T1, seeds=[0, 1, 2], ignore_eos=True, stop=stops
    )
    assert got[0].finish_reason == "stop" and got[0].stop == stop_at and len(got[0].token_ids) <= 7
    for g, w in zip(got, want):
        assert_same(g, w)
    # one stop list for all requests
    same = dec.generate_batch(
        PROMPTS[:3], 20, tree=TreeConfig(2, 3), sampling=T1, seeds=[0, 1, 2], ignore_eos=True, stop=[stop_at]
    )
    assert_same(same[0], want[0])


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_deterministic_engine_outputs_do_not_depend_on_batch_mates(dtype, monkeypatch):
    """`engine(deterministic=True)`: 8 requests decoded together, greedy and sampled, each
    token-identical to its own `generate()` in bf16 too (where the packed forward's products
    round differently and, on this model, change 4 of 8 greedy and 7 of 8 sampled outputs),
    because each lane forwards alone: one target forward per live request per round."""
    target = tiny_llama(0, hidden=64, layers=3, heads=4, kv_heads=2).to(dtype)
    dec = SpeculativeDecoder(target, perturbed(target, noise=0.3, seed=1), backend="native")
    prompts = [[5 + i, 9, 13 + 2 * i, 2, 7 + i] * (1 + i % 3) for i in range(8)]
    for temperature in (0.0, 1.0):
        settings = dict(
            max_new_tokens=40,
            tree=TreeConfig(2, 3),
            sampling=SamplingConfig(temperature=temperature),
            ignore_eos=True,
        )
        solo = [dec.generate(p, seed=i, **settings).token_ids for i, p in enumerate(prompts)]
        engine = dec.engine(max_live=8, deterministic=True)
        ids = [engine.add(p, seed=i, **settings) for i, p in enumerate(prompts)]
        lanes_per_forward = []
        packed = NativeRunner._packed_forward

        def spy(self, lanes, feeds, need_logits):
            lanes_per_forward.append(len(lanes))
            return packed(self, lanes, feeds, need_logits)

        monkeypatch.setattr(NativeRunner, "_packed_forward", spy)
        out = engine.run()
        monkeypatch.undo()
        assert [out[i].token_ids for i in ids] == solo
        assert lanes_per_forward and set(lanes_per_forward) == {1}  # no forward shared by lanes
    with pytest.raises(ValueError, match="deterministic=True needs speculate_max_live=None"):
        dec.engine(deterministic=True, speculate_max_live=2)
