"""Fault containment in the engine: a request's failure stays its own, an interrupt anywhere in
a round leaves every other request exactly where a clean round would, lanes belong to their
owner, a decoder refuses a second concurrent generate(), and memory stays flat.

float64 tiny Llamas, so that a request's output alone and in a batch are bit-identical.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import treespec.engine as engine_module
from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.backends.base import Runner

from .conftest import perturbed, tiny_llama

PROMPTS = [[5, 9, 13, 2], [7, 3, 3, 8, 21], [40, 41, 42], [11, 60, 12, 61, 13]]
T1 = SamplingConfig(temperature=1.0)
SETTINGS = dict(max_new_tokens=24, tree=TreeConfig(2, 3), sampling=T1, ignore_eos=True)


@pytest.fixture(scope="module")
def dec():
    target = tiny_llama(0)
    return SpeculativeDecoder(target, perturbed(target, noise=0.3, seed=1), backend="native")


@pytest.fixture(scope="module")
def solo(dec):
    return [dec.generate(p, seed=i, **SETTINGS).token_ids for i, p in enumerate(PROMPTS)]


def add_all(engine, extra: dict | None = None):
    """Every prompt with its solo seed; `extra[i]`: more settings for request i."""
    extra = extra or {}
    return [engine.add(p, seed=i, **SETTINGS, **extra.get(i, {})) for i, p in enumerate(PROMPTS)]


@pytest.mark.parametrize("round_index", [0, 1, 3])
def test_a_raising_callback_ends_its_request_alone(dec, solo, round_index):
    calls = []

    def callback(ids, sources):
        calls.append(ids)
        if len(calls) > round_index:
            raise ConnectionError("client went away")

    engine = dec.engine(max_live=4)
    ids = add_all(engine, {1: dict(on_tokens=callback)})
    outs = engine.run()
    bad = outs[ids[1]]
    assert bad.finish_reason == "error" and "client went away" in bad.error
    for i in (0, 2, 3):
        assert outs[ids[i]].token_ids == solo[i] and outs[ids[i]].finish_reason == "length"
    assert not engine.live and not engine.waiting and not engine.requests
    again = engine.add(PROMPTS[1], seed=1, **SETTINGS)  # the engine still serves
    assert engine.run()[again].token_ids == solo[1]


def test_a_request_whose_verification_fails_ends_alone(dec, solo, monkeypatch):
    engine = dec.engine(max_live=4)
    ids = add_all(engine)
    victim = engine.requests[ids[2]]
    real = engine_module.verify

    def verify(draft, rows, sampling, rng, *args, **kwargs):
        if rng is victim.rng and victim.stats.target_steps == 2:
            raise ValueError("target model produced NaN or +inf logits")
        return real(draft, rows, sampling, rng, *args, **kwargs)

    monkeypatch.setattr(engine_module, "verify", verify)
    outs = engine.run()
    assert outs[ids[2]].finish_reason == "error" and "NaN" in outs[ids[2]].error
    for i in (0, 1, 3):
        assert outs[ids[i]].token_ids == solo[i]


PHASES = ["propose_many", "score_many", "verify", "commit", "stream"]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("at_round", [1, 3])
def test_an_interrupt_in_any_phase_rolls_the_round_back(dec, solo, monkeypatch, phase, at_round):
    engine = dec.engine(max_live=4)
    state = {"round": 0, "fired": False}
    callbacks = {i: dict(on_tokens=lambda ids, src: None) for i in range(4)}
    ids = add_all(engine, callbacks)

    def fire():
        if state["round"] == at_round and not state["fired"]:
            state["fired"] = True
            raise KeyboardInterrupt

    if phase == "commit":  # the third request's commit: the first two have committed
        victim = engine.requests[ids[2]]
        real_commit = Runner.commit

        def commit(self, nodes):
            if self is engine.targets[victim.lane]:
                fire()
            return real_commit(self, nodes)

        monkeypatch.setattr(Runner, "commit", commit)
    elif phase == "stream":
        real_stream = engine._stream

        def stream():
            fire()
            real_stream()

        monkeypatch.setattr(engine, "_stream", stream)
    else:
        real = getattr(engine_module, phase)

        def wrapped(*args, **kwargs):
            fire()
            return real(*args, **kwargs)

        monkeypatch.setattr(engine_module, phase, wrapped)
    outs = {}
    while engine.waiting or engine.live:
        try:
            engine.step()
        except KeyboardInterrupt:
            pass
        state["round"] += 1
    outs = engine.run()
    assert state["fired"]
    for i in range(4):
        out = outs[ids[i]]
        if phase == "commit" and i == 2 and out.finish_reason == "error":
            continue  # interrupted inside its own commit: it ends, the others are untouched
        assert out.token_ids == solo[i], (phase, i)
    assert not engine.live and not engine.waiting


def test_lanes_belong_to_their_engine(dec, solo):
    """Two engines and generate() interleaved step by step: every output exact."""
    a, b = dec.engine(max_live=2), dec.engine(max_live=2)
    ia = [a.add(PROMPTS[i], seed=i, **SETTINGS) for i in (0, 1)]
    ib = [b.add(PROMPTS[i], seed=i, **SETTINGS) for i in (2, 3)]
    mid = None
    while a.live or a.waiting or b.live or b.waiting:
        a.step()
        b.step()
        if mid is None:
            mid = dec.generate(PROMPTS[3], seed=3, **SETTINGS).token_ids
    outs_a, outs_b = a.run(), b.run()
    assert [outs_a[i].token_ids for i in ia] == solo[:2]
    assert [outs_b[i].token_ids for i in ib] == solo[2:]
    assert mid == solo[3]


def test_a_second_concurrent_generate_is_refused(dec, solo):
    started, release, errors = threading.Event(), threading.Event(), []

    def slow_callback(ids, sources):
        started.set()
        release.wait(10)

    def first():
        dec.generate(PROMPTS[0], seed=0, on_tokens=slow_callback, **SETTINGS)

    thread = threading.Thread(target=first)
    thread.start()
    assert started.wait(10)
    try:
        dec.generate(PROMPTS[1], seed=1, **SETTINGS)
    except RuntimeError as e:
        errors.append(str(e))
    release.set()
    thread.join(10)
    assert errors and "already generating" in errors[0]
    assert dec.generate(PROMPTS[1], seed=1, **SETTINGS).token_ids == solo[1]  # free again


def test_a_callback_that_cancels_its_own_request(dec):
    engine = dec.engine(max_live=2)
    rid = None

    def cancel_me(ids, sources):
        engine.cancel(rid)

    rid = engine.add(PROMPTS[0], seed=0, on_tokens=cancel_me, **SETTINGS)
    other = engine.add(PROMPTS[1], seed=1, **SETTINGS)
    engine.step()
    assert engine.output(rid).finish_reason == "cancelled" == engine.cancel(rid).finish_reason
    assert engine.run()[other].finish_reason == "length"


def test_memory_stays_flat_over_2000_requests():
    import resource

    target = tiny_llama(3, hidden=16, layers=1, heads=2, kv_heads=1)
    dec = SpeculativeDecoder(target, backend="native")
    engine = dec.engine(max_live=8)
    plain = dict(max_new_tokens=2, tree=None, ignore_eos=True)

    def serve(n):
        ids = [engine.add([3, 4, 5 + i % 50], seed=i, **plain) for i in range(n)]
        while engine.waiting or engine.live:
            engine.step()
            for i in [i for i in ids if i in engine.requests and engine.requests[i].output is not None]:
                engine.take(i)

    serve(2000)  # warm-up: allocator pools and lazily built state reach their size
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    serve(2000)
    gc.collect()
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert not engine.requests and grown < 4096, f"peak RSS grew {grown} KiB over 2,000 requests"


def test_a_cache_larger_than_memory_is_refused_before_allocating(dec, solo, monkeypatch):
    """max_live beyond what memory holds is a clear error at once (not an allocator failure
    minutes later), and a cache that must grow past the memory left ends its request alone."""
    from treespec.backends.native import kv

    with pytest.raises(MemoryError, match="KV cache of 10000000 lane.*GiB.*max_live"):
        dec.engine(max_live=10_000_000)
    engine = dec.engine(max_live=5)
    ids = add_all(engine)
    engine.step()  # every lane holds its prompt in the pool's initial capacity
    monkeypatch.setattr(kv, "available_memory", lambda device: 0)  # no memory left to grow
    too_long = engine.add(PROMPTS[0] * 80, seed=9, **SETTINGS)  # more slots than the pool has
    outputs = engine.run()
    failed = outputs[too_long]
    assert failed.finish_reason == "error" and "KV cache" in failed.error and not failed.token_ids
    assert [outputs[i].token_ids for i in ids] == solo


def test_kv_rows_are_allocated_with_use(dec, solo):
    """An engine of 64 lanes serving 4 requests allocates 4 rows of its pool, not 64, and its
    outputs are the solo ones."""
    engine = dec.engine(max_live=64)
    pool = engine.targets[0].pool
    assert pool.rows == 64 and pool.allocated == 1
    ids = add_all(engine)
    outputs = engine.run()
    assert [outputs[i].token_ids for i in ids] == solo
    assert pool.allocated == len(PROMPTS)


def test_edges_are_clear_errors(dec):
    from treespec.rng import TorchRng

    probs = torch.full((1000,), 1e-3, dtype=torch.float64)
    draws = {s: TorchRng(s).categorical(probs, 6) for s in (0, 2**32, 2**33, 2**64 - 1)}
    assert len({tuple(v) for v in draws.values()}) == 4  # every bit of the seed counts
    assert TorchRng(2**40).categorical(probs, 6) == TorchRng(2**40).categorical(probs, 6)
    engine = dec.engine(max_live=1)
    for prompt, match in (({"a": 1}, "got a dict"), ({3, 4}, "got a set"), ([], "prompt is empty")):
        with pytest.raises(ValueError, match=match):
            engine.add(prompt, max_new_tokens=2)
    with pytest.raises(ValueError, match="unknown setting.*max_tokens"):
        engine.add([3, 4], max_tokens=2)
    rid = engine.add([3, 4], max_new_tokens=2)
    with pytest.raises(ValueError, match="no request with id 0.0"):
        engine.cancel(0.0)
    engine.cancel(rid)
    with pytest.raises(ValueError, match="frequency_penalty must be in"):
        SamplingConfig(temperature=0, frequency_penalty=1e39)
