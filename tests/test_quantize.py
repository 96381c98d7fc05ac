"""Weight-only int8 and int4 (`NativeRunner(quantize=...)`, `linear.QuantizedProjection`,
`linear.Int4Projection`): the quantized runner computes exactly the model whose weights are
its dequantized ones (Q * s; int4's (Q - 8) s + z per group of 32), eagerly and compiled, close
to the original within the format's error; a quantized draft keeps greedy decoding equal to
the float target's, and a quantized target's speculative output is the quantized model's own
greedy output. A GGUF file's own 4-bit blocks: tests/test_gguf.py."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from treespec import SpeculativeDecoder, TreeConfig
from treespec.backends.hf import HFRunner
from treespec.backends.linear import (
    INT4_GROUP,
    WIDE_ROWS,
    Int4Projection,
    QuantizedProjection,
    pack_nibbles,
    packing_available,
    unpack_nibbles,
)
from treespec.backends.native import COMPILE_STATIC_MAX, CompiledForward, NativeRunner

from .conftest import perturbed, tiny_llama
from .llamas import CHEAP, GREEDY, PROMPTS, build, compiled_runner, max_diff, random_tree

pytestmark = pytest.mark.cpu  # int8 product kernels differ by CPU (AVX2, AVX512-VNNI, AMX)


def dequantized(model, quantize="int8"):
    """An untied HF copy of `model` whose projections and output layer are the quantized
    runner's matrices: Q * s (int8), or (Q - 8) s + z per group for the projections and int8's
    for the output layer (int4); the embedding lookup keeps the original rows, as the runner does."""
    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    ref = model.__class__(config).to(model.dtype).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"].clone())
    for name, w in state.items():
        if name.endswith("proj.weight") and quantize == "int4":
            state[name] = Int4Projection.quantize(w).weight
        elif name.endswith("proj.weight") or name == "lm_head.weight":
            state[name] = QuantizedProjection(w).weight
    ref.load_state_dict(state)
    return ref


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_projection_multiplies_by_its_dequantized_matrix(dtype, wide):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 64, generator=g).to(dtype), torch.randn(5, 64, generator=g).to(dtype)
    q = QuantizedProjection(w, bias=torch.ones(96, dtype=dtype), wide=wide)
    assert q.weight_int8.dtype == torch.int8 and q.weight_int8.abs().max() == 127
    assert (q.wide is not None) == (wide and packing_available(w.device, dtype))
    want = x.float() @ q.weight.float().t() + 1
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in range(1, 6):  # the wide copy from WIDE_ROWS rows on, int8pack below
        assert (q(x[:rows]).float() - want[:rows]).abs().max() <= tol * want.abs().max()
    assert torch.equal(
        q(x[: WIDE_ROWS - 1]), QuantizedProjection(w, torch.ones(96, dtype=dtype))(x[: WIDE_ROWS - 1])
    )
    # and the dequantized matrix is W within half a quantization step per row (plus, in bf16,
    # the rounding of Q * s to bf16)
    step = w.float().abs().amax(dim=1, keepdim=True) / 127
    rounding = 0 if dtype == torch.float32 else w.float().abs() * 2**-7
    assert ((q.weight.float() - w.float()).abs() <= step * (0.5 + 1e-3) + rounding).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_projection_multiplies_by_its_dequantized_matrix(dtype):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 64, generator=g), torch.randn(5, 64, generator=g).to(dtype)
    q = torch.randint(0, 16, (96, 64), generator=g)
    scales, zeros = torch.rand(96, 2, generator=g) / 8, torch.randn(96, 2, generator=g) / 4
    assert torch.equal(unpack_nibbles(pack_nibbles(q)), q.to(torch.uint8))
    # from blocks: exactly (Q - 8) s + z, the scales and offsets in the compute dtype
    blocks = Int4Projection.from_blocks(pack_nibbles(q), scales, zeros, torch.ones(96, dtype=dtype), dtype)
    s, z = (t.to(dtype).float().repeat_interleave(INT4_GROUP, dim=1) for t in (scales, zeros))
    want_w = (q.float() - 8) * s + z
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    assert (blocks.weight.float() - want_w).abs().max() <= tol * want_w.abs().max()
    want = x.float() @ want_w.t() + 1
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (blocks(x).float() - want).abs().max() <= tol * want.abs().max()
    # quantized by Q4_1's rule: within half a step of W, every group's min and max kept
    quantized = Int4Projection.quantize(w.to(dtype))
    groups = w.to(dtype).float().reshape(96, 2, INT4_GROUP)
    step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(INT4_GROUP, dim=1)
    rounding = 0 if dtype == torch.float32 else w.abs() * 2**-6
    assert ((quantized.weight.float() - w.to(dtype).float()).abs() <= step * (0.5 + 1e-3) + rounding).all()
    with pytest.raises(ValueError, match="whole groups of 32"):
        Int4Projection.quantize(torch.randn(8, 48))
    with pytest.raises(ValueError, match="a multiple of 16 output rows .* use int8"):
        Int4Projection.quantize(torch.randn(50, 64))  # before torch's own RuntimeError


@pytest.mark.parametrize(
    "variant,quantize",
    [
        ("gqa_tied", "int8"),
        ("mha_untied", "int8"),
        ("attention_bias", "int8"),
        ("gqa_tied", "int4"),
        ("attention_bias", "int4"),
    ],
)
def test_quantized_runner_equals_the_dequantized_model(variant, quantize):
    model = build(variant)
    hf, nat = HFRunner(dequantized(model, quantize)), NativeRunner.from_hf(model, quantize=quantize)
    original = HFRunner(model)
    rng = random.Random(0)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(9)]
    for r in (hf, nat, original):
        r.prefill(prompt)
    for size in (1, 3, 12):
        tree = random_tree(rng, size)
        got, want, orig = nat.score(tree), hf.score(tree), original.score(tree)
        assert max_diff(want, got) < 1e-4
        assert 0 < max_diff(orig, got) < 0.05 * orig.abs().max().item()  # int8 is another, close, model
        for r in (hf, nat, original):
            r.commit([0])


# int8 compiles three graphs (~35 s): with -m slow. int4 keeps a compiled quantized runner in
# the default run (and tests/test_aot.py its stored graph); the eager int8 runner == the
# dequantized model and compiled float == HF (tests/test_native.py) stay there too; q4q8's
# graphs call the kernel's op (tests/test_q4q8_forward.py: its eager math).
@pytest.mark.filterwarnings("ignore:treespec's q4q8 kernels are not compiled")
@pytest.mark.parametrize("quantize", [pytest.param("int8", marks=pytest.mark.slow), "int4", "q4q8"])
def test_compiled_quantized_runner_equals_the_eager_one(quantize):
    model = build("gqa_tied")
    eager, nat = (
        NativeRunner.from_hf(model, quantize=quantize),
        compiled_runner(model, CHEAP, quantize=quantize),
    )
    rng = random.Random(3)
    prompt = [rng.randrange(model.config.vocab_size) for _ in range(7)]
    for r in (eager, nat):
        r.prefill(prompt)
    for size in (1, 5, 1, 12):
        tree = random_tree(rng, size)
        assert max_diff(eager.score(tree), nat.score(tree)) < 1e-4
        for r in (eager, nat):
            r.commit([0])
    assert not nat.compiled.failed
    # int4 in process: the decode step's graph and the dynamic one (dynamo keeps no dimension of
    # size 1 dynamic; from a store one graph serves both, tests/test_aot.py); int8 as float
    # weights, a graph per size
    assert nat.compiled.compiled == ({1, 5, "dynamic"} if quantize == "int8" else {1, "dynamic"})
    if quantize == "q4q8":  # every product of the graph through the kernel's op
        assert {m.kind for m in nat.compiled.module.modules() if hasattr(m, "kind")} == {"q4q8"}


def test_each_weight_format_compiles_the_products_measured_faster():
    """int4: one dynamic graph for every feed (no static one), inductor's C++ template for
    every product untimed; q4q8: one dynamic graph for every feed too, its kernel's products
    (a 1-token graph of its own fused bf16 steps apart from the tree graph's, and greedy
    speculative output left greedy plain output); bf16: oneDNN's packed products in both,
    nothing tuned; float32 and int8: a tuned graph per small feed size and untuned products
    for longer feeds. Nothing compiles here."""
    model = build("gqa_tied")
    auto, packed, templates = CompiledForward.AUTOTUNED, CompiledForward.PACKED, CompiledForward.TEMPLATES
    for quantize, dtype, static, dynamic, static_max in (
        ("int4", torch.float32, templates, templates, 0),
        ("q4q8", torch.bfloat16, packed, packed, 0),
        (None, torch.bfloat16, packed, packed, 1),
        (None, torch.float32, auto, packed, COMPILE_STATIC_MAX),
        ("int8", torch.bfloat16, auto, packed, COMPILE_STATIC_MAX),
    ):
        graphs = CompiledForward(NativeRunner.from_hf(model, dtype=dtype, quantize=quantize))
        assert (graphs.config, graphs.static_max) == ({"static": static, "dynamic": dynamic}, static_max)


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_greedy_with_quantized_models_is_lossless(quantize):
    target = tiny_llama(0).float()
    draft = perturbed(target, noise=0.3, seed=1)
    int8 = {"quantize": quantize}
    int8_draft = SpeculativeDecoder(NativeRunner.from_hf(target), NativeRunner.from_hf(draft, **int8))
    int8_both = SpeculativeDecoder(NativeRunner.from_hf(target, **int8), NativeRunner.from_hf(draft, **int8))
    accepted = 0
    for prompt in PROMPTS[:4]:
        want = int8_draft.generate(prompt, 24, sampling=GREEDY, ignore_eos=True).token_ids  # tree=None: plain
        want8 = int8_both.generate(prompt, 24, sampling=GREEDY, ignore_eos=True).token_ids
        for tree in (TreeConfig(1, 3), TreeConfig(2, 3)):
            out = int8_draft.generate(prompt, 24, tree=tree, sampling=GREEDY, ignore_eos=True)
            assert out.token_ids == want  # a quantized draft: the float target's output
            out8 = int8_both.generate(prompt, 24, tree=tree, sampling=GREEDY, ignore_eos=True)
            assert out8.token_ids == want8  # a quantized target: the int8 model's own output
            accepted += out.sources.count("accepted") + out8.sources.count("accepted")
    assert accepted > 0


def test_bad_quantize_settings_are_clear_errors(tmp_path):
    model = build("gqa_tied")
    with pytest.raises(ValueError, match="unknown quantize 'int3'; choose None or one of int8, int4"):
        NativeRunner.from_hf(model, quantize="int3")
    with pytest.raises(ValueError, match="not torch.float64"):
        NativeRunner.from_hf(model.double(), quantize="int8")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="needs the native backend"):
        SpeculativeDecoder.from_pretrained(tmp_path, backend="hf", quantize="int8")
