"""quantize="q4q8": the native forward with every projection through the int4-weight x
int8-activation kernel (issue 58; kernels in tests/test_kernels.py).

The runner against a float64 reference of the same quantized math; a tree node's logits bit for
bit its root-to-node path's scored alone (the kernel's rows are independent, and so is the rest
of the eager float32 forward where attention runs `row_attention`: torch's CPU SDPA rounds a
row by the span and the mask's layout); greedy speculative output == greedy plain output; the compiled
forward == the eager one, stored ahead of time; a GGUF file's own blocks packed as they are;
bad settings are clear errors."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from treespec import SpeculativeDecoder, TreeConfig
from treespec.backends.checkpoint import LlamaShape
from treespec.backends.kernels import attention as row_kernel
from treespec.backends.kernels import quantize_activations
from treespec.backends.linear import Q4Q8Projection, pack_nibbles
from treespec.backends.native import CompiledForward, NativeRunner
from treespec.backends.native.aot import GraphStore
from treespec.tree import TokenTree

from .conftest import perturbed, tiny_llama
from .llamas import CHEAP, GREEDY, PROMPTS, build, max_diff, random_tree

pytestmark = pytest.mark.filterwarnings("ignore:treespec's q4q8 kernels are not compiled")


class Float64Product:
    """A `Q4Q8Projection`'s math in float64: the activations rounded as the kernel rounds them
    (per row and group of 32), times the dequantized weight, plus the bias."""

    def __init__(self, p: Q4Q8Projection):
        self.out_features, self.in_features = p.out_features, p.in_features
        self.w = p.packed.dequantize(torch.float64)
        self.bias = None if p.bias is None else p.bias.double()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q, s, _ = quantize_activations(x.reshape(-1, self.in_features))
        g = self.in_features // 32
        xq = (q.double().reshape(-1, g, 32) * s.double()[..., None]).reshape(x.shape)
        y = xq @ self.w.t()
        return y if self.bias is None else y + self.bias


def float64_reference(model) -> NativeRunner:
    """A float64 runner whose products are the q4q8 runner's, each as `Float64Product`."""
    q4q8 = NativeRunner.from_hf(model, quantize="q4q8")
    ref = NativeRunner.from_hf(copy.deepcopy(model).double())
    ref.lm_head = Float64Product(q4q8.lm_head)
    for mine, theirs in zip(ref.layers, q4q8.layers, strict=True):
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(mine, name, Float64Product(getattr(theirs, name)))
    return ref


def path_to(tree: TokenTree, node: int) -> list[int]:
    nodes = []
    while node >= 0:
        nodes.append(node)
        node = tree.parents[node]
    return nodes[::-1]


@pytest.mark.parametrize("variant", ["gqa_tied", "attention_bias"])
def test_q4q8_runner_equals_a_float64_reference_of_its_math(variant):
    model = build(variant)
    nat, ref = NativeRunner.from_hf(model, quantize="q4q8"), float64_reference(model)
    assert all(
        isinstance(p, Q4Q8Projection)
        for p in [nat.lm_head]
        + [getattr(layer, n) for layer in nat.layers for n in ("qkv", "o", "gate_up", "down")]
    )
    dense = NativeRunner.from_hf(model)
    rng = random.Random(0)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(9)]
    for r in (nat, ref, dense):
        r.prefill(prompt)
    for size in (1, 4, 13):
        tree = random_tree(rng, size)
        got, want, orig = nat.score(tree), ref.score(tree), dense.score(tree)
        scale = want.abs().max().item()
        # float32 vs float64 hidden states may round an activation to the neighbouring int8 step
        assert max_diff(want.float(), got) < 2e-3 * scale
        assert 0 < max_diff(orig, got) < 0.1 * orig.abs().max().item()  # another, close, model
        for r in (nat, ref, dense):
            r.commit([0])


def float64_sdpa(q, k, v, attn_mask=None, scale=None, enable_gqa=False, **kw):
    """SDPA computed in float64 and rounded once to q's dtype: whatever the span, the mask's
    layout or the other rows, a row's float32 result is its exact value rounded (but for a
    value within 1e-16 of a rounding boundary)."""
    q, k, v = q.double(), k.double(), v.double()
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    w = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if attn_mask is not None:
        w = w.masked_fill(~attn_mask, float("-inf"))
    return (w.softmax(-1) @ v).float()


def tree_and_paths(runner, prompt, tree):
    """(the tree's logits [n, V], each node's as its root-to-node path scored alone [n, V])."""
    runner.reset()
    runner.prefill(prompt)
    full = runner.score(tree)
    alone = []
    for node in range(len(tree.tokens)):
        nodes = path_to(tree, node)
        runner.reset()
        runner.prefill(prompt)
        alone.append(
            runner.score(TokenTree([tree.tokens[j] for j in nodes], [-1, *range(len(nodes) - 1)]))[-1]
        )
    runner.reset()
    return full, torch.stack(alone)


@pytest.mark.parametrize("prompt_len", [9, 505])
def test_a_tree_node_scores_bit_for_bit_as_its_path_alone(prompt_len, monkeypatch):
    """Row independence end to end (float32, eager): the node's logits do not depend on the
    other nodes of the forward, nor on how many there are (505: the tree crosses 512 keys).
    Attention computes in float64 here: torch's SDPA on a CPU rounds a row differently with
    the span and where its visible keys sit among masked ones (the next test), which is what
    the rest of the forward must not do."""
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", float64_sdpa)
    model = build("gqa_tied", max_positions=1024)
    runner = NativeRunner.from_hf(model, quantize="q4q8")
    rng = random.Random(prompt_len)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(prompt_len)]
    for size in (6, 24):
        full, alone = tree_and_paths(runner, prompt, random_tree(rng, size))
        assert torch.equal(full, alone), size


@pytest.mark.skipif(not row_kernel.available(), reason="row_attention needs the compiled kernels and AVX512")
def test_a_tree_node_scores_bit_for_bit_as_its_path_alone_under_the_native_attention():
    """With `row_attention` (torch's CPU SDPA rounds a row by its span and mask layout, which
    q4q8's int8 rounding of the o projection's input hid mostly, not always)."""
    model = build("gqa_tied", max_positions=1024)
    runner = NativeRunner.from_hf(model, quantize="q4q8")
    rng = random.Random(505)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(505)]
    for size in (6, 24):
        full, alone = tree_and_paths(runner, prompt, random_tree(rng, size))
        assert torch.equal(full, alone), size


def test_greedy_speculative_output_equals_greedy_plain_output():
    target = tiny_llama(0).float()
    draft = perturbed(target, noise=0.3, seed=1)
    q = {"quantize": "q4q8"}
    dec = SpeculativeDecoder(NativeRunner.from_hf(target, **q), NativeRunner.from_hf(draft, **q))
    accepted = 0
    for prompt in PROMPTS[:4]:
        want = dec.generate(prompt, 24, sampling=GREEDY, ignore_eos=True).token_ids  # tree=None: plain
        for tree in (TreeConfig(1, 3), TreeConfig(3, 4)):
            out = dec.generate(prompt, 24, tree=tree, sampling=GREEDY, ignore_eos=True)
            assert out.token_ids == want
            accepted += out.sources.count("accepted")
    assert accepted > 0


@pytest.mark.slow  # ~18 s; graphs stored ahead: test_aot.py; q4q8 compiled == eager: test_quantize.py
@pytest.mark.cpu
def test_q4q8_graphs_are_stored_ahead_of_time_under_a_key_of_their_own(tmp_path):
    """The store compiles the q4q8 graphs with the custom op in them (AOTInductor), keyed apart
    from every other weights format's."""
    model = build("gqa_tied")
    digests = {
        q: CompiledForward(NativeRunner.from_hf(model, quantize=q)).digest() for q in (None, "int4", "q4q8")
    }
    assert len(set(digests.values())) == 3
    eager = NativeRunner.from_hf(model, quantize="q4q8")
    nat = NativeRunner.from_hf(model, compile=True, quantize="q4q8")
    nat.compiled = CompiledForward(nat, CHEAP, GraphStore(tmp_path))
    rng = random.Random(4)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(9)]
    for r in (eager, nat):
        r.prefill(prompt)
    for size in (1, 10):
        tree = random_tree(rng, size)
        assert max_diff(eager.score(tree), nat.score(tree)) < 1e-4
        for r in (eager, nat):
            r.commit([0])
    assert not nat.compiled.failed and set(nat.compiled.packages) == {1, "dynamic"}
    assert len(list(tmp_path.glob("*.pt2"))) == 2


def test_a_gguf_files_blocks_are_packed_as_they_are():
    """From the int4 form of GGUF's blocks (w = (q - 8) s + z, float16 d and m): the same matrix
    int4 multiplies by, not rounded again; the runner reads them where the checkpoint carries them."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (40, 64), generator=g)
    d = (torch.rand(40, 2, generator=g) / 8).half().float()
    m = (torch.randn(40, 2, generator=g) / 4).half().float()
    zeros = m + 8 * d
    p = Q4Q8Projection.from_blocks(pack_nibbles(q), d, zeros)
    want = (q.float().reshape(40, 2, 32) * d[..., None] + m[..., None]).reshape(40, 64)
    assert torch.equal(p.weight, want)
    with pytest.raises(ValueError, match="use quantize_q4_1"):
        Q4Q8Projection.from_blocks(pack_nibbles(q), d + 1e-4, zeros)  # not float16 numbers

    model = build("gqa_tied")
    state = dict(model.state_dict())
    name = "model.layers.0.mlp.down_proj.weight"
    out, k = state[name].shape
    qd = torch.randint(0, 16, (out, k), generator=g)
    dd = (torch.rand(out, k // 32, generator=g) / 8).half().float()
    md = (torch.randn(out, k // 32, generator=g) / 8).half().float()
    state |= {f"{name}.q4": pack_nibbles(qd), f"{name}.q4_scales": dd, f"{name}.q4_zeros": md + 8 * dd}
    runner = NativeRunner(LlamaShape.from_config(model.config), state, quantize="q4q8")
    want = (qd.float().reshape(out, -1, 32) * dd[..., None] + md[..., None]).reshape(out, k)
    assert torch.equal(runner.layers[0].down.weight, want)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4q8_runs_a_gguf_files_own_blocks(qtype, tmp_path):
    """A converted GGUF file (q and k rows un-permuted by the loader, then packed): every
    product, the (here 4-bit) output layer's too, multiplies by the file's dequantized weights
    exactly, in 4 bits."""
    import gguf

    from treespec.loading.gguf import convert

    from .ggufs import tiny, write_gguf

    model = tiny()  # write_gguf gives it the file's dequantised weights
    write_gguf(model, tmp_path / "m.gguf", getattr(gguf.GGMLQuantizationType, qtype), tokenizer=False)
    runner = NativeRunner.from_pretrained(convert(tmp_path / "m.gguf", tmp_path / "cache"), quantize="q4q8")
    state = model.state_dict()
    for i, layer in enumerate(runner.layers):
        w = lambda name: state[f"model.layers.{i}.{name}.weight"]  # noqa: E731
        qkv = torch.cat([w("self_attn.q_proj"), w("self_attn.k_proj"), w("self_attn.v_proj")])
        assert torch.equal(layer.qkv.weight, qkv)
        assert torch.equal(layer.o.weight, w("self_attn.o_proj"))
        assert torch.equal(layer.gate_up.weight, torch.cat([w("mlp.gate_proj"), w("mlp.up_proj")]))
        assert torch.equal(layer.down.weight, w("mlp.down_proj"))
    assert isinstance(runner.lm_head, Q4Q8Projection)
    assert torch.equal(runner.lm_head.weight, state["lm_head.weight"])


def test_q4q8_multiplies_an_8_bit_output_layer_by_its_own_q8_0_blocks(tmp_path):
    """Where the file keeps the output layer in 8 bits (Q8_0, as llama.cpp's converters do),
    q4q8 multiplies by exactly those weights in 8 bits, not by a 4-bit rounding of them."""
    import gguf

    from treespec.backends.kernels import PackedQ8
    from treespec.loading.gguf import convert

    from .ggufs import tiny, write_gguf

    model = tiny()
    write_gguf(model, tmp_path / "m.gguf", gguf.GGMLQuantizationType.Q8_0, tokenizer=False)
    runner = NativeRunner.from_pretrained(convert(tmp_path / "m.gguf", tmp_path / "cache"), quantize="q4q8")
    assert isinstance(runner.lm_head.packed, PackedQ8)
    assert torch.equal(runner.lm_head.weight, model.state_dict()["lm_head.weight"])


def test_bad_q4q8_settings_are_clear_errors():
    model = build("gqa_tied")
    with pytest.raises(ValueError, match="q4q8' runs on a CPU only"):
        NativeRunner.from_hf(model, device="cuda", quantize="q4q8")
    with pytest.raises(ValueError, match="q4q8' computes in float32 or bfloat16"):
        NativeRunner.from_hf(model, dtype=torch.float16, quantize="q4q8")
    with pytest.raises(ValueError, match="whole groups of 32 inputs, not a weight"):
        NativeRunner.from_hf(build("gqa_tied", hidden_size=48), quantize="q4q8")
    with pytest.raises(ValueError, match="whole groups of 32 inputs, not a weight"):
        Q4Q8Projection.quantize(torch.randn(8, 48))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="runs on a CPU only"):
            Q4Q8Projection.quantize(torch.randn(8, 64, device="cuda"))


def test_a_q4q8_target_drafts_with_a_q4q8_head_by_default(monkeypatch):
    """`draft_quantize="auto"` gives the default pair's feature head the target's q4q8 kernel
    where the target runs q4q8 (`loading.resolve_quantize`), and drafts. (Greedy speculative ==
    greedy plain: tests/test_row_attention.py.)"""
    from treespec import SpeculativeDecoder, TreeConfig
    from treespec.backends.head import HeadRunner

    monkeypatch.delenv("TREESPEC_PAIR", raising=False)  # the suite's default is pycode
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dec = SpeculativeDecoder.from_pretrained(quantize="q4q8")
    assert dec.target_runner.quantize == "q4q8" and isinstance(dec.draft_runner, HeadRunner)
    assert dec.draft_runner.quantize == "q4q8"
    chat = [{"role": "user", "content": "Name three colours."}]
    out = dec.generate(chat, 16, tree=TreeConfig(1, 3), sampling=GREEDY)
    assert out.stats.accepted_by_depth[0] > 0
