"""Chunked prefill (`treespec.prefill`): a prompt loaded in pieces under the engine's per-step
token budget (`round_tokens`) leaves the cache one prefill leaves and the same output, while
live requests keep decoding; cancellation stops a prompt between pieces; the KV budget makes
requests wait; and the native pool gives its memory back after long prompts.

float64 tiny Llamas (native and HF backends), so that a prompt fed in pieces and fed whole
cannot disagree on a coin or an argmax through rounding; table models for exact enumeration.
"""

from __future__ import annotations

import pytest
import torch

import treespec.prefill as prefill_module
from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.prefill import DEFAULT_ROUND_TOKENS, piece_sizes

from .conftest import VOCAB, perturbed, tiny_llama
from .heads import head_runner, random_head
from .llamas import assert_cache_equals_prefill, record_feeds
from .toy import LONG_PROMPT, SAMPLINGS, K, TableHead, TableRunner, enumerate_outcomes, max_abs_diff, pair

GREEDY = SamplingConfig(temperature=0)
T1 = SamplingConfig(temperature=1.0)
# lengths 10, 17 and 23: no multiple of any chunk size tested
PROMPTS = [[(5 * i + 3 * j) % (VOCAB - 2) + 2 for j in range(n)] for i, n in enumerate((10, 17, 23))]
# one case per verification rule: (tree, verification)
RULES = {
    "token": (TreeConfig(2, 3), "token"),  # i.i.d. siblings
    "traversal": (TreeConfig(2, 2, "without_replacement"), "traversal"),
    "block": (TreeConfig(1, 4), "block"),  # a chain
}


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0)
    return target, perturbed(target, noise=0.3, seed=1)


@pytest.fixture(scope="module")
def long_target():
    return tiny_llama(2, hidden=16, layers=1, heads=2, kv_heads=1, max_positions=4096)


def outputs(dec: SpeculativeDecoder, round_tokens, tree, verification, sampling, n=12, **engine):
    """Every prompt of PROMPTS at once in one engine (the short ones decode while the long
    ones load); their outputs in order."""
    eng = dec.engine(max_live=3, round_tokens=round_tokens, **engine)
    ids = [
        eng.add(p, max_new_tokens=n, tree=tree, sampling=sampling, seed=i, verification=verification)
        for i, p in enumerate(PROMPTS)
    ]
    outs = eng.run()
    return [outs[i] for i in ids]


def assert_same(got, want) -> None:
    assert got.token_ids == want.token_ids
    assert got.sources == want.sources
    assert got.finish_reason == want.finish_reason and got.verification == want.verification
    for name in ("target_steps", "tokens", "tree_nodes", "accepted_by_depth", "draft_forwards"):
        assert getattr(got.stats, name) == getattr(want.stats, name), name


# ---- which tokens a step feeds ---------------------------------------------------------------
def test_pieces_fill_the_budget_shortest_remaining_first():
    assert piece_sizes([(0, 10, False), (0, 10, False)], 4, 4) == [4, 0]  # a tie: admission order
    assert piece_sizes([(8, 10, False), (0, 10, False), (0, 5, False)], 7, 7) == [2, 0, 5]
    assert piece_sizes([(10, 10, False), (3, 10, False)], 4, 4) == [0, 4]  # a whole prompt feeds nothing
    assert piece_sizes([(0, 10, False), (0, 10, False)], None, None) == [10, 10]  # unchunked: whole
    # a short request behind long prompts loads at once, and they go on with what is left
    assert piece_sizes([(0, 3000, False), (256, 3000, False), (0, 6, False)], 256, 256) == [0, 250, 6]


def test_aligned_pieces_end_at_fixed_positions_whatever_the_budget():
    """A batch-invariant lane's pieces end at multiples of round_tokens: a piece that does not
    fit waits (and the requests after it), unless nothing was fed before it."""
    assert piece_sizes([(0, 10, True)], 2, 4) == [4]  # the step's first piece: fed whole
    assert piece_sizes([(6, 10, True)], 4, 4) == [2]  # to the next multiple of 4
    assert piece_sizes([(0, 3, False), (0, 10, True), (0, 12, False)], 4, 4) == [3, 0, 0]


# ---- the same cache and the same output as one prefill ----------------------------------------
@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("rule", list(RULES))
@pytest.mark.parametrize("sampling", [GREEDY, T1], ids=["greedy", "T1"])
def test_chunked_prefill_outputs_equal_one_prefill(models, backend, rule, sampling):
    """Chunk sizes 1, 3 and 7 against unchunked, three prompts decoding and loading together,
    a draft model drafting: token for token, sources and statistics, for every rule."""
    dec = SpeculativeDecoder(*models, backend=backend)
    tree, verification = RULES[rule]
    want = outputs(dec, None, tree, verification, sampling)
    for chunk in (1, 3, 7):
        for got, w in zip(outputs(dec, chunk, tree, verification, sampling), want):
            assert_same(got, w)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_a_prompt_loaded_in_pieces_leaves_the_caches_of_one_prefill(models, backend, monkeypatch):
    """The target's and the draft's lanes hold exactly a fresh prefill of the prompt, fed in
    pieces of at most the budget, while another request decodes."""
    target, draft = models
    dec = SpeculativeDecoder(target, draft, backend=backend)
    eng = dec.engine(max_live=2, round_tokens=7)
    eng.add(PROMPTS[0][:2], max_new_tokens=100, tree=TreeConfig(2, 2), sampling=T1, seed=0, ignore_eos=True)
    eng.step()
    fed = record_feeds(monkeypatch)
    long = eng.add(PROMPTS[2], max_new_tokens=5, tree=TreeConfig(2, 2), sampling=T1, seed=1)
    while eng.requests[long].status == "waiting" or eng.requests[long].loading:
        eng.step()
    monkeypatch.undo()
    assert max(fed) <= 7  # no forward fed more than the budget (nor a tree more nodes: 7)
    lane, n = eng.requests[long].lane, len(PROMPTS[2]) - 1
    # loaded, and one round decoded since: the caches hold the prompt, then the round's tokens
    assert eng.targets[lane].committed[:n] == eng.drafts[lane].committed[:n] == PROMPTS[2][:-1]
    assert_cache_equals_prefill(eng.targets[lane], target)
    assert_cache_equals_prefill(eng.drafts[lane], draft)


def test_a_feature_head_reads_every_piece_as_one_prefill():
    """The head drafter reads the target's features of every piece in order (float64 Llama
    and a random head): outputs equal one prefill's, for chunk sizes 1, 3 and 7."""
    target = tiny_llama(0)
    cfg, w = random_head(target, draft_vocab=64, seed=8)
    dec = SpeculativeDecoder(target, head_runner(target, cfg, w))
    assert dec.drafter.kind == "head"
    for sampling in (GREEDY, SamplingConfig(temperature=0.8)):
        want = outputs(dec, None, TreeConfig(2, 2), None, sampling)
        assert sum(o.stats.draft_forwards for o in want) > 0
        for chunk in (1, 3, 7):
            for got, w_ in zip(outputs(dec, chunk, TreeConfig(2, 2), None, sampling), want):
                assert_same(got, w_)


TOY_CASES = [
    ("model", TreeConfig(2, 2), "token", "T1"),
    ("model", TreeConfig(2, 1, "without_replacement"), "traversal", "T0.6-topk2"),
    ("model", TreeConfig(1, 2), "block", "T1.4-topp0.7"),
    ("head", TreeConfig(2, 2), None, "T1"),  # TableHead checks every feature it is fed
]


@pytest.mark.parametrize(
    "drafter,tree,rule,sampling_name", TOY_CASES, ids=[c[2] or "head" for c in TOY_CASES]
)
@pytest.mark.parametrize("chunk", [1, 3])
def test_chunked_prefill_is_lossless_by_enumeration(drafter, tree, rule, sampling_name, chunk):
    """Every draw and coin enumerated with table models, the 5-token prompt loaded in pieces
    of 1 or 3 (4 cached tokens): the output joint is the target's, for every rule and the head."""
    target, draft_model = pair()
    draft = TableRunner(draft_model) if drafter == "model" else TableHead(target, draft_model, LONG_PROMPT[0])
    dec = SpeculativeDecoder(TableRunner(target), draft)
    sampling = SAMPLINGS[sampling_name]

    def run(rng):
        eng = dec.engine(max_live=1, round_tokens=chunk)
        i = eng.add(
            list(LONG_PROMPT), K, tree=tree, sampling=sampling, rng=rng, ignore_eos=True, verification=rule
        )
        return tuple(eng.run()[i].token_ids)

    got = enumerate_outcomes(run)
    assert abs(sum(got.values()) - 1) < 1e-9
    assert max_abs_diff(got, target.joint(LONG_PROMPT, K, sampling)) < 1e-9


# ---- scheduling: decodes go on, cancellation, the KV budget -----------------------------------
def test_a_live_decode_gets_a_round_every_step_while_a_long_prompt_loads(models):
    dec = SpeculativeDecoder(*models)
    eng = dec.engine(max_live=2, round_tokens=8)
    short = eng.add(PROMPTS[0][:3], max_new_tokens=400, tree=None, sampling=T1, seed=0, ignore_eos=True)
    eng.step()
    prompt = PROMPTS[2] * 8  # 184 tokens
    long = eng.add(prompt, max_new_tokens=4, tree=TreeConfig(2, 2), sampling=T1, seed=1)
    steps = 0
    while eng.requests[long].status == "waiting" or eng.requests[long].loading:
        emitted = eng.step()
        steps += 1
        assert len(emitted.get(short, [])) == 1  # the decode's round, every step
        status = eng.status()
        assert status.prefilling == (1 if eng.requests[long].loading else 0)
        assert set(status.live) == {short, long} and status.round_tokens == 8
    # 8 prompt tokens a step: 183 cached tokens in 23 steps
    assert steps == -(-(len(prompt) - 1) // 8)
    out = eng.run()[long]
    assert_same(out, dec.generate(prompt, 4, tree=TreeConfig(2, 2), sampling=T1, seed=1))


def test_cancel_between_pieces_frees_the_lane_and_its_kv_slots(models):
    dec = SpeculativeDecoder(*models)
    prompt = PROMPTS[2] * 4
    need = len(prompt) + 8 + TreeConfig(2, 2).max_depth
    eng = dec.engine(max_live=2, round_tokens=4, max_kv_tokens=need + 10)  # one such request at a time
    settings = dict(max_new_tokens=8, tree=TreeConfig(2, 2), sampling=T1)
    first = eng.add(prompt, seed=0, **settings)
    second = eng.add(prompt, seed=1, **settings)
    eng.step()
    status = eng.status()
    assert status.live == (first,) and status.prefilling == 1 and status.waiting == 1
    lane = eng.requests[first].lane
    assert eng.targets[lane].n_committed == 4 < len(prompt) - 1  # loaded in part
    out = eng.cancel(first)
    assert out.finish_reason == "cancelled" and out.token_ids == []
    assert eng.kv_tokens == 0 and not eng.live
    assert eng.targets[lane].n_committed == 0  # the lane forgot it (and gave its memory back)
    outs = eng.run()
    assert_same(outs[second], dec.generate(prompt, seed=1, **settings))


def test_the_kv_budget_lets_one_long_prompt_load_at_a_time(models):
    dec = SpeculativeDecoder(*models)
    prompt = PROMPTS[2] * 3
    need = len(prompt) + 6 + TreeConfig(2, 2).max_depth
    eng = dec.engine(max_live=3, round_tokens=8, max_kv_tokens=need)
    settings = dict(max_new_tokens=6, tree=TreeConfig(2, 2), sampling=T1)
    ids = [eng.add(prompt, seed=s, **settings) for s in range(3)]
    while eng.waiting or eng.live:
        eng.step()
        assert len(eng.live) <= 1 and eng.kv_tokens <= need
    outs = eng.run()
    for s, i in enumerate(ids):
        assert_same(outs[i], dec.generate(prompt, seed=s, **settings))


def test_an_interrupt_between_pieces_loses_nothing(models, monkeypatch):
    """A KeyboardInterrupt in a piece's forward: the next step feeds it again, and every
    output is the uninterrupted one."""
    dec = SpeculativeDecoder(*models)
    tree, verification = RULES["token"]
    want = outputs(dec, 3, tree, verification, T1)
    real, calls = prefill_module.prefill_many, []

    def interrupted(jobs):
        calls.append(1)
        if len(calls) in (2, 5):
            raise KeyboardInterrupt
        return real(jobs)

    monkeypatch.setattr(prefill_module, "prefill_many", interrupted)
    eng = dec.engine(max_live=3, round_tokens=3)
    ids = [eng.add(p, max_new_tokens=12, tree=tree, sampling=T1, seed=i) for i, p in enumerate(PROMPTS)]
    while eng.waiting or eng.live:
        try:
            eng.step()
        except KeyboardInterrupt:
            pass
    outs = eng.run()
    assert len(calls) > 5
    for i, w in zip(ids, want):
        assert_same(outs[i], w)


def test_a_prefill_that_fails_ends_its_request_alone(models, monkeypatch):
    """A piece whose cache cannot grow (no memory left): its request ends with an error, the
    others in the same packed forward are untouched."""
    from treespec.backends.native import kv

    dec = SpeculativeDecoder(*models)
    tree, verification = RULES["token"]
    want = outputs(dec, 8, tree, verification, T1)
    eng = dec.engine(max_live=4, round_tokens=2000)
    ids = [eng.add(p, max_new_tokens=12, tree=tree, sampling=T1, seed=i) for i, p in enumerate(PROMPTS)]
    eng.step()
    monkeypatch.setattr(kv, "available_memory", lambda device: 0)
    big = eng.add(PROMPTS[2] * 20, max_new_tokens=4, tree=tree, sampling=T1, seed=9)
    outs = eng.run()
    assert outs[big].finish_reason == "error" and "KV cache" in outs[big].error
    for i, w in zip(ids, want):
        assert_same(outs[i], w)


def test_the_default_budget_and_none(models):
    dec = SpeculativeDecoder(*models)
    assert dec.engine().round_tokens == DEFAULT_ROUND_TOKENS
    assert dec.engine(round_tokens=None).status().round_tokens is None
    with pytest.raises(ValueError, match="round_tokens must be None or an integer >= 1"):
        dec.engine(round_tokens=0)


# ---- memory returns ----------------------------------------------------------------------------
def test_the_pool_shrinks_back_after_long_prompts_and_holds_steady_serving(long_target):
    """Long prompts grow the pool; once their requests end it shrinks back (to twice the
    initial capacity, two rows); steady short requests then never reallocate it."""
    dec = SpeculativeDecoder(long_target)
    eng = dec.engine(max_live=8)
    pool = eng.targets[0].pool
    short = dict(max_new_tokens=4, tree=None, sampling=T1, ignore_eos=True)
    for s in range(6):  # six long prompts at once: eight rows of 1,400 slots
        eng.add(PROMPTS[2] * 60, seed=s, **short)
    peak = (0, 0)
    while eng.live or eng.waiting:
        eng.step()
        peak = (max(peak[0], pool.capacity), max(peak[1], pool.allocated))
    assert peak[0] > 1380 and peak[1] == 8
    assert pool.capacity == 2 * 256 and pool.allocated == 2
    assert not any(pool.filled)
    kv = pool.kv
    for s in range(20):
        eng.add(PROMPTS[s % 3], seed=s, **short)
        eng.add(PROMPTS[(s + 1) % 3], seed=s, **short)
        eng.run()
    assert pool.kv is kv  # no reallocation in steady serving


def test_a_decoders_own_runners_keep_their_sequence_after_generate(models):
    """generate() leaves its sequence in the decoder's runners (a chat's next turn reuses it)."""
    dec = SpeculativeDecoder(*models)
    out = dec.generate(PROMPTS[1], 6, tree=TreeConfig(2, 2), sampling=T1, seed=0, ignore_eos=True)
    assert dec.target_runner.committed == PROMPTS[1] + out.token_ids[:-1]


def test_a_shrunk_pool_keeps_what_its_lanes_hold(long_target):
    dec = SpeculativeDecoder(long_target)
    lanes = dec.target_runner.lanes(8)
    for lane, n in zip(lanes, (2000, 3, 0, 0, 0, 9)):
        lane.prefill(torch.arange(n).remainder(VOCAB).tolist())
    pool = lanes[0].pool
    assert pool.capacity == 2000 and pool.allocated == 6
    lanes[0].release()
    assert pool.capacity == 512 and pool.allocated == 6  # rows 1 and 5 still hold slots
    for lane in (lanes[1], lanes[5]):
        assert_cache_equals_prefill(lane, long_target)
    lanes[5].release()
    assert pool.allocated == 6  # row 1 holds slots: 6 rows are not over four times two
    lanes[1].release()
    assert pool.capacity == 512 and pool.allocated == 2 and not any(pool.filled)
