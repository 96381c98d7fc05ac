"""Compiled forwards kept across processes (`treespec.backends.native.aot.GraphStore`): a graph compiled
ahead of time is stored once and loaded by later runners of the same weights, settings,
source and machine, never by others; a broken package is rebuilt; a graph that cannot be
compiled ahead of time is compiled in process instead, and not tried again.

Each test compiles at most two small graphs (a 2-layer model, no autotuning): ~30 s each."""

from __future__ import annotations

import os
import random
import time

import pytest
import torch

from treespec.backends.native import CompiledForward, NativeRunner, aot, kv
from treespec.backends.native import compile as compile_module
from treespec.backends.native.aot import GraphStore
from treespec.backends.native.compile import resolve_compile
from treespec.tree import TokenTree

from .conftest import VOCAB
from .llamas import CHEAP, build, max_diff


def runner(model, store: GraphStore | None) -> NativeRunner:
    """A compiled native runner whose graphs come from `store` (None: compiled in process)."""
    nat = NativeRunner.from_hf(model, compile=True)
    nat.compiled = CompiledForward(nat, CHEAP, store)
    return nat


def decode(nat: NativeRunner, prompt: list[int], tree: TokenTree) -> list[torch.Tensor]:
    """The logits of a one-token step and of a tree after it: the one-token graph and the
    dynamic graph."""
    nat.reset()
    nat.prefill(prompt)
    one = nat.score(TokenTree([prompt[-1]], [-1]))
    nat.commit([0])
    return [one, nat.score(tree)]


def setting():
    rng = random.Random(3)
    prompt = [rng.randrange(VOCAB) for _ in range(9)]
    # past COMPILE_STATIC_MAX nodes: the dynamic graph
    tree = TokenTree([rng.randrange(VOCAB) for _ in range(10)], [-1, 0, 0, 1, 1, 2, 2, 3, 4, 5])
    return prompt, tree


@pytest.mark.cpu
def test_a_stored_graph_is_loaded_by_a_later_runner_not_compiled_again(tmp_path, monkeypatch):
    monkeypatch.setattr(kv, "INITIAL_CAPACITY", 8)  # the cache grows under the packages
    model = build("gqa_tied")
    prompt, tree = setting()
    eager = NativeRunner.from_hf(model)
    store = GraphStore(tmp_path)
    first = runner(model, store)
    want = decode(eager, prompt, tree)
    got = decode(first, prompt, tree)
    assert not first.compiled.failed and set(first.compiled.packages) == {1, "dynamic"}
    assert all(max_diff(w, g) < 1e-4 for w, g in zip(want, got))
    assert len(list(tmp_path.glob("*.pt2"))) == 2
    longer = prompt * 5  # a longer span and a grown cache: the exported sizes stay free
    pairs = zip(decode(eager, longer, tree), decode(first, longer, tree))
    assert all(max_diff(w, g) < 1e-4 for w, g in pairs)
    assert first.capacity > 32

    # a later runner (another process, as far as the store can tell) loads both graphs
    monkeypatch.setattr(GraphStore, "build", lambda *a, **k: pytest.fail("compiled again"))
    second = runner(model, store)
    second.compiled.graph = lambda *a: pytest.fail("compiled in process")
    again = decode(second, prompt, tree)
    assert set(second.compiled.packages) == {1, "dynamic"}
    assert all(max_diff(w, g) < 1e-4 for w, g in zip(want, again))

    # compile="auto" (build=False): the stored graphs run; an empty store leaves the forward
    # eager, graph by graph, and compiles nothing
    third = NativeRunner.from_hf(model, compile=True)
    third.compiled = CompiledForward(third, CHEAP, store, build=False)
    assert third.compiled.stored()
    third.load_graphs()
    assert set(third.compiled.packages) == {1, "dynamic"}
    assert all(max_diff(w, g) < 1e-4 for w, g in zip(want, decode(third, prompt, tree)))
    assert not third.compiled.unbuilt
    empty = GraphStore(tmp_path / "empty")
    fourth = NativeRunner.from_hf(model, compile=True)
    fourth.compiled = CompiledForward(fourth, CHEAP, empty, build=False)
    assert not fourth.compiled.stored()
    fourth.load_graphs()
    assert all(max_diff(w, g) < 1e-4 for w, g in zip(want, decode(fourth, prompt, tree)))
    assert fourth.compiled.unbuilt == {1, "dynamic"} and not fourth.compiled.packages
    assert not (tmp_path / "empty").exists()


def test_compile_auto_runs_stored_graphs_of_quantized_weights_only(tmp_path, monkeypatch):
    """compile="auto" asks the store for quantized weights on a CPU (float weights pick their eager
    layout at load, before the store could answer); with nothing stored, the eager forward."""
    cpu = torch.device("cpu")
    assert resolve_compile("auto", cpu, torch.float32, "int8") == "auto"
    assert resolve_compile("auto", cpu, torch.float32, None) is False
    assert resolve_compile("auto", cpu, torch.float64, "int8") is False
    assert resolve_compile("auto", cpu, torch.float32, "int8", tp=object()) is False
    assert resolve_compile(False, cpu, torch.float32, "int8") is False
    with pytest.warns(UserWarning, match="compile=True ignored"):
        assert resolve_compile(True, cpu, torch.float64, None) is False
    with pytest.raises(ValueError, match="True, False or 'auto'"):
        resolve_compile("yes", cpu, torch.float32, None)
    monkeypatch.setenv("TREESPEC_GRAPHS", str(tmp_path))
    with monkeypatch.context() as m:  # an empty store is answered without hashing the weights
        m.setattr(compile_module, "model_digest", lambda *a, **k: pytest.fail("hashed for an empty store"))
        nat = NativeRunner.from_hf(build("gqa_tied"), quantize="int8", compile="auto")
    assert nat.compile_setting == "auto" and nat.compiled is None
    monkeypatch.setattr(CompiledForward, "stored", lambda self: True)  # as if the store held them
    nat = NativeRunner.from_hf(build("gqa_tied"), quantize="int8", compile="auto")
    plain = nat.compiled
    assert plain is not None and not plain.build
    nat.set_taps((1,))  # a head's target: the store is asked for the graphs of these taps
    assert nat.compiled is not None and not nat.compiled.build and nat.compiled.digest() != plain.digest()
    nat.set_taps(())
    assert nat.compiled is plain


@pytest.mark.cpu
def test_the_key_changes_with_the_model_the_settings_and_the_machine(monkeypatch):
    """The weights, the taps a graph returns, which graph, its settings, the source, the
    machine: each names another package."""
    a = NativeRunner.from_hf(build("gqa_tied", seed=0), compile=True)
    b = NativeRunner.from_hf(build("gqa_tied", seed=1), compile=True)
    same = NativeRunner.from_hf(build("gqa_tied", seed=0), compile=True)
    ma, mb = a.compiled.digest(), b.compiled.digest()
    assert ma != mb and ma == same.compiled.digest()
    a.set_taps((1,))  # a feature head's target: its graphs return the taps' features too
    assert a.compiled.digest() not in (ma, mb)
    key = GraphStore.key(ma, 1, CHEAP)
    assert key == GraphStore.key(ma, 1, dict(CHEAP))
    assert len({key, GraphStore.key(mb, 1, CHEAP), GraphStore.key(ma, "dynamic", CHEAP),
                GraphStore.key(ma, 1, {**CHEAP, "max_autotune": True})}) == 4  # fmt: skip
    real = aot.machine_key
    monkeypatch.setattr(aot, "machine_key", lambda: {**real(), "cpu": "another"})
    assert GraphStore.key(ma, 1, CHEAP) != key
    monkeypatch.setattr(aot, "source_digest", lambda: "edited")
    assert GraphStore.key(ma, 1, CHEAP) != key


# not `cpu`: what it checks (a corrupt package is rebuilt) is the store's, the same on every
# core, and the compiled code's own check is the test above (37 s more as an AVX2 core)
def test_a_broken_package_is_compiled_again(tmp_path):
    """A corrupt file where the one-token graph's package is looked for: removed, compiled
    again and replaced. (One graph compiled once: writing the packages first took 45 s.)"""
    model = build("gqa_tied")
    prompt, _ = setting()
    store = GraphStore(tmp_path)
    nat, eager = runner(model, store), NativeRunner.from_hf(model)
    broken = store.path(GraphStore.key(nat.compiled.digest(), 1, nat.compiled.config["static"]))
    broken.write_bytes(b"not a package")
    one = TokenTree([prompt[-1]], [-1])
    for r in (nat, eager):
        r.prefill(prompt)
    assert max_diff(eager.score(one), nat.score(one)) < 1e-4
    assert not nat.compiled.failed and 1 in nat.compiled.packages
    assert [p.name for p in tmp_path.glob("*.pt2")] == [broken.name]
    assert broken.stat().st_size > 1000  # replaced by a package


@pytest.mark.cpu
def test_a_graph_that_cannot_be_compiled_ahead_runs_compiled_in_process(tmp_path, monkeypatch):
    model = build("gqa_tied")
    prompt, tree = setting()
    eager = NativeRunner.from_hf(model)

    def broken(*a, **k):
        raise RuntimeError("export refused")

    monkeypatch.setattr(GraphStore, "build", broken)
    store = GraphStore(tmp_path)
    nat = runner(model, store)
    # the in-process compiler is a stand-in (the graph's module, run eagerly): what it compiles
    # is tests/test_native.py's (compiled == HF); here, that the store falls back to it (two
    # compiles took 19 s)
    nat.compiled.graph = nat.compiled.module
    nat.reset()
    nat.prefill(prompt)
    with pytest.warns(UserWarning, match="ahead of time failed .*export refused.*in this process"):
        got = nat.score(TokenTree([prompt[-1]], [-1]))
    eager.prefill(prompt)
    assert max_diff(eager.score(TokenTree([prompt[-1]], [-1])), got) < 1e-4
    assert not nat.compiled.failed and nat.compiled.packages == {} and 1 in nat.compiled.compiled
    assert len(list(tmp_path.glob("*.failed"))) == 1
    # a later runner does not try again (no warning, no build)
    monkeypatch.setattr(GraphStore, "build", lambda *a, **k: pytest.fail("tried again"))
    later = runner(model, store)
    later.compiled.graph = later.compiled.module
    later.prefill(prompt)
    later.score(TokenTree([prompt[-1]], [-1]))
    assert later.compiled.packages == {}


def test_int4_weights_get_one_stored_graph_for_every_feed(tmp_path):
    """With int4 weights the store compiles one graph, exported from the first (one-token) feed
    with the row count free from 1, and it serves one token and trees alike."""
    model = build("gqa_tied")
    prompt, tree = setting()
    eager = NativeRunner.from_hf(model, quantize="int4")
    nat = NativeRunner.from_hf(model, compile=True, quantize="int4")
    nat.compiled = CompiledForward(nat, CHEAP, GraphStore(tmp_path))
    nat.compiled.static_max = CompiledForward.products("int4", torch.float32)[2]
    for got, want in zip(decode(nat, prompt, tree), decode(eager, prompt, tree)):
        assert max_diff(want, got) < 1e-4
    assert not nat.compiled.failed and set(nat.compiled.packages) == {"dynamic"}
    assert len(list(tmp_path.glob("*.pt2"))) == 1


def test_a_graph_the_templates_cannot_take_is_stored_autotuned(tmp_path, monkeypatch):
    """TEMPLATES leaves a product no kernel but inductor's C++ template; where that fails, the
    graph is compiled ahead of time under AUTOTUNED, quietly, and the templates' key is not
    tried again. The store's build is a stand-in here (the graph's module, run eagerly): nothing compiles."""
    model = build("gqa_tied")
    prompt, _ = setting()
    built = []

    def build_package(store, key, module, inputs, dims, settings):
        built.append(settings)
        if settings.get("max_autotune_gemm_backends") == "CPP":
            raise RuntimeError("No choices exist for backend.")
        return module

    monkeypatch.setattr(GraphStore, "build", build_package)
    store = GraphStore(tmp_path)
    nat = NativeRunner.from_hf(model, compile=True)
    nat.compiled = CompiledForward(nat, CompiledForward.TEMPLATES, store)
    nat.prefill(prompt)
    got = nat.score(TokenTree([prompt[-1]], [-1]))  # no warning: the second settings compiled
    assert built == [CompiledForward.TEMPLATES, CompiledForward.AUTOTUNED]
    assert not nat.compiled.failed and 1 in nat.compiled.packages
    assert len(list(tmp_path.glob("*.failed"))) == 1  # the templates' key, not tried again
    eager = NativeRunner.from_hf(model)
    eager.prefill(prompt)
    assert max_diff(eager.score(TokenTree([prompt[-1]], [-1])), got) < 1e-4
    assert CompiledForward.candidates(CompiledForward.PACKED) == [CompiledForward.PACKED]


@pytest.mark.cpu
def test_a_store_removes_the_packages_not_used_for_its_keep_days(tmp_path):
    store = GraphStore(tmp_path, keep_days=1)
    now = time.time()
    for name, age_days in (("old", 3), ("recent", 0.5), ("new", 0)):
        path = tmp_path / f"{name}.pt2"
        path.write_bytes(b"x")
        os.utime(path, (now - age_days * 86400,) * 2)
    store.prune()
    assert sorted(p.name for p in tmp_path.glob("*.pt2")) == ["new.pt2", "recent.pt2"]
