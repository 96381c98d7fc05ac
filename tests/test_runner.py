"""Both backends: the tree forward equals sequential decoding, and commit keeps the cache exact."""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from treespec import SamplingConfig, SpeculativeDecoder, TokenTree, TreeConfig
from treespec.backends import make_runner
from treespec.backends.hf import HFRunner
from treespec.backends.native import NativeRunner

from .conftest import VOCAB, tiny_llama
from .llamas import assert_cache_equals_prefill, record_feeds, tol
from .toy import trees

PREFIX = [3, 17, 42, 8, 25, 60, 11]

MODELS = {
    "llama-sdpa": lambda: tiny_llama(0),
    "llama-eager": lambda: tiny_llama(0, attn="eager"),
    "llama32-shaped": lambda: tiny_llama(2, llama32=True),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


@pytest.fixture(params=["native", "hf"])
def backend(request, model):
    if request.param == "native" and model.config._attn_implementation == "eager":
        pytest.skip("the eager/sdpa distinction is HF's; native has one attention path")
    return request.param


def sequential_logits(model, tokens: list[int]) -> torch.Tensor:
    """Next-token logits after `tokens`, from a plain full forward with no cache."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -1]


def test_tree_logits_equal_each_path_run_sequentially(model, backend):
    tree = TokenTree.from_choices(
        5, [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [1, 0, 0]], [[9, 4, 77], [30, 2], [51]]
    )
    runner = make_runner(model, backend)
    runner.prefill(PREFIX)
    logits = runner.score(tree)
    for i in range(len(tree)):
        path_tokens = [tree.tokens[n] for n in tree.path_to(i)]
        torch.testing.assert_close(
            logits[i], sequential_logits(model, PREFIX + path_tokens), rtol=0, atol=tol(model)
        )


def test_tree_built_over_two_forwards(model, backend):
    """Level-by-level drafting feeds a tree in several calls; later nodes see earlier pending ones."""
    runner = make_runner(model, backend)
    runner.prefill(PREFIX)
    root = runner.extend([5], [-1])
    kids = runner.extend([9, 4], [0, 0])
    grandkids = runner.extend([30, 31, 2], [1, 1, 2])
    torch.testing.assert_close(root[0], sequential_logits(model, PREFIX + [5]), rtol=0, atol=tol(model))
    torch.testing.assert_close(kids[1], sequential_logits(model, PREFIX + [5, 4]), rtol=0, atol=tol(model))
    torch.testing.assert_close(
        grandkids[1], sequential_logits(model, PREFIX + [5, 9, 31]), rtol=0, atol=tol(model)
    )
    torch.testing.assert_close(
        grandkids[2], sequential_logits(model, PREFIX + [5, 4, 2]), rtol=0, atol=tol(model)
    )
    runner.commit([0, 1, 4])
    assert runner.committed == PREFIX + [5, 9, 31]
    assert_cache_equals_prefill(runner, model)


@pytest.mark.parametrize("strategy", ["iid", "without_replacement", "topk"])
def test_cache_after_20_rounds_equals_fresh_prefill(model, strategy, backend):
    draft = tiny_llama(1, hidden=16, layers=1, heads=2, kv_heads=1)
    dec = SpeculativeDecoder(model, draft, backend=backend)
    out = dec.generate(
        PREFIX,
        60,
        tree=TreeConfig(3, 3, strategy),
        sampling=SamplingConfig(temperature=1.0),
        seed=0,
        ignore_eos=True,
    )
    assert out.stats.target_steps >= 20
    assert dec.target_runner.committed == PREFIX + out.token_ids[:-1]
    assert_cache_equals_prefill(dec.target_runner, model)
    # the draft cache is a (possibly lagging) prefix of the same sequence
    d = dec.draft_runner
    assert d.committed == (PREFIX + out.token_ids)[: d.n_committed]
    assert_cache_equals_prefill(d, draft)


@given(tree=trees(max_nodes=10), pick=st.integers(0, 10**6), prefix=st.integers(1, 6))
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@pytest.mark.parametrize("backend", ["native", "hf"])
def test_compaction_of_any_root_to_node_path(tree, pick, prefix, backend):
    model = _shared_model()
    runner = make_runner(model, backend)
    runner.prefill(PREFIX[:prefix])
    tokens = [t % VOCAB for t in tree.tokens]
    tree = TokenTree(tokens, tree.parents)
    runner.score(tree)
    path = tree.path_to(pick % len(tree))
    runner.commit(path)
    assert runner.committed == PREFIX[:prefix] + [tokens[n] for n in path]
    assert_cache_equals_prefill(runner, model)


_MODEL = []


def _shared_model():
    if not _MODEL:
        _MODEL.append(tiny_llama(0))
    return _MODEL[0]


def test_eager_mask_is_additive_float_and_sdpa_mask_is_bool():
    visible = torch.tensor([[True, False], [True, True]])
    sdpa, eager = HFRunner(tiny_llama(0)), HFRunner(tiny_llama(0, attn="eager"))
    assert sdpa.mask_4d(visible[None, None]).dtype == torch.bool
    m = eager.mask_4d(visible[None, None])
    assert m.dtype == torch.float64 and m.shape == (1, 1, 2, 2)
    assert m[0, 0, 0, 0] == 0 and m[0, 0, 0, 1] == torch.finfo(torch.float64).min


@pytest.mark.parametrize("impl", ["flash_attention_2", "flash_attention_3", "flex_attention"])
def test_attention_that_ignores_4d_masks_is_rejected(impl):
    fake = types.SimpleNamespace(config=types.SimpleNamespace(_attn_implementation=impl, vocab_size=8))
    with pytest.raises(ValueError, match="sdpa"):
        HFRunner(fake)


def test_commit_rejects_a_non_chain():
    runner = HFRunner(_shared_model())
    runner.prefill(PREFIX)
    runner.score(TokenTree([1, 2, 3], [-1, 0, 0]))
    with pytest.raises(ValueError, match="chain"):
        runner.commit([0, 1, 2])


# ---- choosing a backend ----------------------------------------------------------------------
def test_make_runner_picks_native_and_falls_back_to_hf_with_a_notice(capsys):
    from transformers import GPT2Config, GPT2LMHeadModel

    assert isinstance(make_runner(tiny_llama(0)), NativeRunner)
    assert isinstance(make_runner(tiny_llama(0), "hf"), HFRunner)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB)).eval()
    assert isinstance(make_runner(gpt2, "auto"), HFRunner)
    notice = capsys.readouterr().err.strip().splitlines()
    assert len(notice) == 1 and "native backend unsupported" in notice[0] and "gpt2" in notice[0]
    with pytest.raises(ValueError, match="native backend cannot run this model.*use backend='hf'"):
        make_runner(gpt2, "native")
    with pytest.raises(ValueError, match="backend must be one of auto, native, hf"):
        make_runner(tiny_llama(0), "vllm")
    with pytest.raises(ValueError, match="expected a Hugging Face causal LM or a treespec Runner"):
        make_runner("meta-llama/Llama-3.2-1B")


@pytest.mark.parametrize(
    "flags,faster,want",
    [
        ("fpu sse avx512f avx512_bf16", True, torch.bfloat16),  # bf16 measured faster (the EPYC case)
        ("fpu sse avx512f avx512_bf16", False, torch.float32),  # measured slower (the Xeon-without-AMX case)
        ("fpu amx_bf16 amx_tile", False, torch.bfloat16),  # AMX: bf16, no measurement needed
        ("fpu sse avx2", True, torch.float32),  # no bf16 instructions: emulated, never bf16
    ],
)
@pytest.mark.cpu
def test_auto_dtype_follows_the_cpu_flags_and_measurement(monkeypatch, tmp_path, flags, faster, want):
    from treespec import backends

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    read = backends.cpu_bf16_flags
    monkeypatch.setattr(backends.cpu, "cpu_bf16_flags", lambda: read(str(cpuinfo)))
    monkeypatch.setattr(backends.cpu, "bf16_matmul_is_faster", lambda: faster)
    monkeypatch.setattr(backends.cpu, "bf16_kernels_enabled", lambda: True)
    assert backends.auto_dtype("cpu") == want
    # the same flags where torch may not use them (an emulated AVX2 core): fp32
    monkeypatch.setattr(backends.cpu, "bf16_kernels_enabled", lambda: False)
    assert backends.auto_dtype("cpu") == torch.float32
    assert backends.auto_dtype("cpu", "draft") == torch.float32  # a small draft is op-bound on CPU
    assert (
        backends.auto_dtype("cuda") == backends.auto_dtype("cuda", "draft") == torch.bfloat16
    )  # no device is touched
    assert read("/nonexistent") == set()
    assert (
        backends.cpu_model(str(cpuinfo)) == backends.cpu_model("/nonexistent") == "cpu"
    )  # no model name line
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: AMD EPYC 9454\nflags\t\t: {flags}\n")
    assert backends.cpu_model(str(cpuinfo)) == "AMD EPYC 9454" and read(str(cpuinfo)) == set(
        flags.split()
    ) & {"amx_bf16", "avx512_bf16"}


@pytest.mark.cpu
def test_bf16_probe_answers_and_is_cached():
    from treespec import backends

    assert backends.bf16_matmul_is_faster() in (True, False)
    assert (
        backends.bf16_matmul_is_faster.cache_info().hits + backends.bf16_matmul_is_faster.cache_info().misses
        >= 1
    )


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_prefix_reuse_prefills_only_what_is_new_and_changes_no_output(backend, temperature, monkeypatch):
    """A chat's second turn with `prefix_reuse` on both runners: the target and the draft feed
    only the tokens after what their caches share with the new prompt, and the output (float64,
    seeded) equals a decoder that starts from empty caches."""
    target = tiny_llama(0).double()
    fresh, reusing = (SpeculativeDecoder(target, tiny_llama(1).double(), backend=backend) for _ in range(2))
    for runner in (reusing.target_runner, reusing.draft_runner):
        runner.prefix_reuse = True
    settings = dict(tree=TreeConfig(2, 3), sampling=SamplingConfig(temperature=temperature), ignore_eos=True)
    first = reusing.generate(PREFIX, 12, seed=0, **settings)
    second_prompt = PREFIX + first.token_ids + [5, 9]  # the next turn extends the first
    fed = record_feeds(monkeypatch)
    got = reusing.generate(second_prompt, 12, seed=1, **settings)
    prefill = fed[:2]  # the target's prefill, then the draft's
    monkeypatch.undo()
    want = fresh.generate(second_prompt, 12, seed=1, **settings)
    assert got.token_ids == want.token_ids
    shared = len(PREFIX) + len(first.token_ids) - 1  # the last token of turn 1 was never fed
    new = len(second_prompt) - 1 - shared  # a fresh prefill feeds len(second_prompt) - 1 = 20
    # the draft's cache lags the target's by the tokens of the last round it did not feed
    assert prefill[0] == new and new <= prefill[1] <= new + 3, prefill


def test_a_cpu_choice_is_measured_once_per_machine(monkeypatch, tmp_path):
    """`cpu.remembered` keeps a measured choice on disk per machine: read back, not measured
    again; measured again for another machine or a corrupt file, never an error."""
    from treespec.backends import cpu

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    calls = []

    def measure(value=True):
        calls.append(value)
        return value

    assert cpu.remembered("choice", measure) is True
    assert cpu.remembered("choice", lambda: measure(False)) is True and calls == [True]  # read back
    assert cpu.remembered("other", lambda: measure(False)) is False and calls == [True, False]
    monkeypatch.setattr(cpu, "machine_key", lambda: {"cpu": "another"})
    assert cpu.remembered("choice", lambda: measure(False)) is False  # another machine: measured
    (tmp_path / cpu.CHOICES_FILE).write_text("{not json")
    assert cpu.remembered("choice", measure) is True and calls == [True, False, False, True]


def test_a_cpu_choice_measured_on_a_busy_machine_is_kept_for_a_while_only(monkeypatch, tmp_path):
    import time

    from treespec.backends import cpu

    class Busy:
        busy, others = True, 0.5

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def describe(self):
            return "50%"

    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu, "CpuWatch", Busy)
    assert cpu.remembered("choice", lambda: True) is True
    assert cpu.remembered("choice", lambda: False) is True  # processes started meanwhile agree
    later = time.time() + cpu.BUSY_KEEP_SECONDS + 1
    monkeypatch.setattr(cpu.time, "time", lambda: later)
    assert cpu.remembered("choice", lambda: False) is False  # later ones measure again


def test_a_runner_with_the_old_hook_names_still_works():
    """A Runner subclass written against the hooks' former names (`_forward`, `_keep`, ...) gets
    them under the new ones, with a DeprecationWarning."""
    from treespec.backends.base import Runner, Scores

    with pytest.warns(DeprecationWarning, match=r"Old\._forward is deprecated.* forward"):

        class Old(Runner):
            vocab_size, max_positions = 4, None

            def _reset_cache(self):
                self.slots = 0

            def _forward(self, tokens, positions, visible, need_logits):
                self.slots += len(tokens)
                return Scores(torch.zeros(len(tokens), 4) if need_logits else None)

            def _keep(self, nodes):
                self.kept = list(nodes)

    runner = Old()
    runner.prefill([1, 2])
    assert runner.score(TokenTree([3, 1, 2], [-1, 0, 0])).shape == (3, 4) and runner.slots == 5
    runner.commit([0, 2])
    assert runner.kept == [0, 2] and runner.committed == [1, 2, 3, 2]
