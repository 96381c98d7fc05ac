"""The native Llama backend against the HF runner: tree forwards, multi-round commits, drafting
level by level, loading from safetensors, bf16, the flash cascade's math, cache growth, the
forward's building blocks (norm, fused RoPE) on the SmolLM2 shape, and the compiled forward."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config

from treespec.backends import attention, linear
from treespec.backends.attention import reference_prefix_attention
from treespec.backends.base import prefill_many, score_many
from treespec.backends.checkpoint import LlamaShape, unsupported_reason
from treespec.backends.hf import HFRunner, load_model
from treespec.backends.linear import Projection, packing_available
from treespec.backends.native import (
    CompiledForward,
    NativeRunner,
    compile_unsupported_reason,
    kv,
    rms_norm,
    rope_rows,
    rotate,
)
from treespec.backends.native import compile as native_compile
from treespec.tree import TokenTree

from .conftest import tiny_llama
from .llamas import (
    CHEAP,
    LLAMA3_ROPE,
    VARIANTS,
    VOCAB,
    build,
    compiled_runner,
    max_diff,
    random_tree,
)


def logits_many(runners, trees):
    """`score_many`'s logits, one tensor per runner."""
    return [s.logits for s in score_many(list(zip(runners, trees)))]


def runners(model, **kw):
    return HFRunner(model), NativeRunner.from_hf(model, **kw)


def level_tree(rng: random.Random, widths: list[int]) -> TokenTree:
    """A tree with nodes in level order (so feeding it level by level keeps node indices)."""
    tokens, parents, level = [rng.randrange(VOCAB)], [-1], [0]
    for w in widths:
        new = []
        for _ in range(w):
            parents.append(rng.choice(level))
            tokens.append(rng.randrange(VOCAB))
            new.append(len(tokens) - 1)
        level = new
    return TokenTree(tokens, parents)


def random_chain(rng: random.Random, tree: TokenTree) -> list[int]:
    """A root-first chain of node indices: a prefix of a random root-to-node path (maybe empty)."""
    path = tree.path_to(rng.randrange(len(tree)))
    return path[: rng.randint(0, len(path))]


TOL = {torch.float32: 1e-4, torch.float64: 1e-9}


# ---- 1. prefill + tree forwards ------------------------------------------------------------
def projections(runner: NativeRunner) -> list[Projection]:
    return [runner.lm_head] + [
        p for layer in runner.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ]


@pytest.mark.parametrize(
    "dtype, packed", [(torch.float32, False), (torch.float32, True), (torch.float64, False)]
)
@pytest.mark.cpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_tree_logits_match_hf(variant, dtype, packed, monkeypatch):
    """fp32 runs twice: the tiny weights as they are (below linear.MIN_PACKED_FP32: plain BLAS)
    and with every projection in oneDNN's packed layout, biases fused (the big models' path)."""
    if packed:
        if not packing_available(torch.device("cpu"), dtype):
            pytest.skip("this torch has no oneDNN packed linear")
        monkeypatch.setattr(linear, "MIN_PACKED_FP32", 0)
    model = build(variant, dtype)
    hf, nat = runners(model)
    assert all((p.packed is not None) == packed for p in projections(nat))
    assert nat.dtype == dtype and nat.vocab_size == VOCAB and nat.eos_token_ids == frozenset({1, 2})
    rng = random.Random(1)
    prompt = [rng.randrange(VOCAB) for _ in range(11)]
    for r in (hf, nat):
        r.prefill(prompt)
    for size in (1, 9, 17):
        tree = random_tree(rng, size)
        assert max_diff(hf.score(tree), nat.score(tree)) < TOL[dtype]
        chain = random_chain(rng, tree)
        for r in (hf, nat):
            r.commit(chain)
        toks, parents = [rng.randrange(VOCAB) for _ in range(3)], [-1, 0, 0]  # a drafting step after it
        assert max_diff(hf.extend(toks, parents), nat.extend(toks, parents)) < TOL[dtype]
        for r in (hf, nat):
            r.commit([0])


# ~12 s (a 128k x 2048 embedding): with -m slow. The default run keeps each of its parts on
# small models: tied embeddings (gqa_tied), llama3 RoPE (llama3_rope, inv_freq == HF's),
# every projection packed (packed=True), GQA, and the SmolLM2-shaped model's real sizes.
@pytest.mark.cpu
@pytest.mark.slow
def test_llama32_1b_shaped():
    """Llama-3.2-1B's shape (hidden 2048, 32 q / 8 kv heads, head_dim 64, 128k vocab, tied,
    llama3 rope theta 500k factor 32), cut to ONE layer to stay fast."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=1,  # the real model has 16
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters=dict(LLAMA3_ROPE, factor=32.0, original_max_position_embeddings=8192),
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    hf, nat = runners(model)
    assert nat.embed.shape == (128256, 2048)  # tied: the lm_head projects by the embedding matrix
    assert (nat.lm_head.out_features, nat.lm_head.in_features) == (128256, 2048)
    if packing_available(nat.device, nat.dtype):  # real sizes take oneDNN's packed layout in fp32
        assert all(p.packed is not None for p in projections(nat))
    assert nat.capacity < 1024  # 128k positions are not allocated up front
    assert torch.equal(nat.inv_freq, model.model.rotary_emb.inv_freq)
    rng = random.Random(0)
    prompt = [rng.randrange(128256) for _ in range(20)]
    for r in (hf, nat):
        r.prefill(prompt)
    tree = TokenTree([rng.randrange(128256) for _ in range(6)], [-1, 0, 0, 1, 1, 2])
    assert max_diff(hf.score(tree), nat.score(tree)) < 1e-4


@pytest.mark.parametrize("fold_max", [0, attention.FOLD_MAX_QUERIES])
def test_both_gqa_layouts_match_hf(fold_max, monkeypatch):
    """Feeds of at most FOLD_MAX_QUERIES tokens fold the query heads sharing a kv head into the
    query axis (mask repeated per head), longer ones use SDPA's enable_gqa: both layouts, on
    one lane and on packed lanes, are HF's attention (float64, 1e-9). fold_max=0: never fold."""
    monkeypatch.setattr(attention, "FOLD_MAX_QUERIES", fold_max)
    model = build("gqa_tied", torch.float64)
    rng = random.Random(11)
    hfs, nat = [HFRunner(model) for _ in range(2)], NativeRunner.from_hf(model)
    lanes = nat.lanes(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (70, 9)]  # one prefill past 64 tokens
    prefill_many(list(zip(hfs, prompts)))
    prefill_many(list(zip(lanes, prompts)))
    for _ in range(3):
        trees = [random_tree(rng, 9), random_tree(rng, 5)]
        for want, got in zip(logits_many(hfs, trees), logits_many(lanes, trees)):
            assert max_diff(want, got) < 1e-9
        chains = [random_chain(rng, t) for t in trees]
        for runners_ in (hfs, lanes):
            for r, chain in zip(runners_, chains):
                r.commit(chain)
    nat.prefill(prompts[0])  # one lane alone: the single-lane attention path
    hf_alone = HFRunner(model)
    hf_alone.prefill(prompts[0])
    tree = random_tree(rng, 9)
    assert max_diff(hf_alone.score(tree), nat.score(tree)) < 1e-9


# ---- 2. many rounds of score + commit --------------------------------------------------------
@pytest.mark.parametrize("variant", ["gqa_tied", "llama3_rope", "qwen2_bias"])
def test_multi_round_cache_equals_fresh_prefill(variant):
    model = build(variant)
    hf, nat = runners(model)
    rng = random.Random(2)
    prompt = [rng.randrange(VOCAB) for _ in range(7)]
    for r in (hf, nat):
        r.prefill(prompt)
    saw = set()
    for _ in range(24):
        tree = random_tree(rng, rng.randint(1, 12))
        assert max_diff(hf.score(tree), nat.score(tree)) < 1e-4
        chain = random_chain(rng, tree)
        saw.add("empty" if not chain else "in order" if chain == list(range(len(chain))) else "moved")
        for r in (hf, nat):
            r.commit(chain)
        assert hf.committed == nat.committed and nat.filled == nat.n_committed
    assert saw == {"empty", "in order", "moved"}

    fresh = NativeRunner.from_hf(model)
    fresh.prefill(nat.committed)
    c = nat.n_committed
    assert max_diff(nat.kv[..., :c, :], fresh.kv[..., :c, :]) < 1e-5
    nxt = TokenTree([rng.randrange(VOCAB)], [-1])
    a, b, h = nat.score(nxt), fresh.score(nxt), hf.score(nxt)
    assert max_diff(a, b) < 1e-5 and max_diff(a, h) < 1e-4

    # a prefill after a committed prefix (the draft catching up): causal after the cache
    more = [rng.randrange(VOCAB) for _ in range(5)]
    for r in (hf, nat):
        r.commit([0])
        r.prefill(more)
    assert max_diff(hf.score(nxt), nat.score(nxt)) < 1e-4


# ---- 3. drafting level by level == one tree forward -------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extend_level_by_level_matches_score(dtype):
    model = build("gqa_tied", dtype)
    whole, levels = NativeRunner.from_hf(model), NativeRunner.from_hf(model)
    rng = random.Random(3)
    prompt = [rng.randrange(VOCAB) for _ in range(9)]
    for r in (whole, levels):
        r.prefill(prompt)
    for widths in ([3, 4, 2], [1, 1, 1, 1], [2, 1, 3]):
        tree = level_tree(rng, widths)
        expected = whole.score(tree)
        depths = torch.tensor(tree.depths)
        got = []
        for d in range(tree.max_depth + 1):
            idx = [i for i in range(len(tree)) if tree.depths[i] == d]
            got.append(levels.extend([tree.tokens[i] for i in idx], [tree.parents[i] for i in idx]))
        assert max_diff(torch.cat(got), expected) < TOL[dtype] * 0.1
        chain = tree.path_to(int(torch.argmax(depths)))  # the deepest path
        for r in (whole, levels):
            r.commit(chain)
        c = whole.n_committed
        assert max_diff(whole.kv[..., :c, :], levels.kv[..., :c, :]) < TOL[dtype] * 0.1


# ---- 4. loading ---------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["mha_untied", "gqa_tied", "qwen2_bias"])
def test_from_pretrained_equals_from_hf(variant, tmp_path):
    model = build(variant)
    model.generation_config.eos_token_id = 5
    model.save_pretrained(tmp_path)
    a, b = NativeRunner.from_hf(model), NativeRunner.from_pretrained(tmp_path)
    assert b.eos_token_ids == frozenset({5}) and b.max_positions == 512 and b.shape == a.shape
    tree = random_tree(random.Random(4), 8)
    for r in (a, b):
        r.prefill([3, 1, 4, 1, 5])
    assert torch.equal(a.score(tree), b.score(tree))


def test_from_pretrained_sharded(tmp_path):
    model = build("mha_untied")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    a, b = NativeRunner.from_hf(model), NativeRunner.from_pretrained(tmp_path)
    for r in (a, b):
        r.prefill([7, 8, 9])
    tree = random_tree(random.Random(5), 5)
    assert torch.equal(a.score(tree), b.score(tree))


@pytest.mark.parametrize("stored_as", ["model.embed_tokens.weight", "lm_head.weight"])
def test_tied_checkpoint_saved_either_way_loads(tmp_path, stored_as):
    """A tied model whose one matrix is stored under either name (llama.cpp converters and some
    exporters keep only lm_head.weight) loads, with HF's logits."""
    from safetensors.torch import save_file

    model = tiny_llama(2, llama32=True)  # tied embeddings
    model.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in ("lm_head.weight",)}
    state[stored_as] = state.pop("model.embed_tokens.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    runner = NativeRunner.from_pretrained(tmp_path, dtype=torch.float64)
    tokens = [3, 17, 42, 8]
    with torch.no_grad():
        want = model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(runner.extend(tokens, [-1, 0, 1, 2]), want, atol=1e-9, rtol=0)


def test_bundled_pair_loads():
    from treespec.zoo import pair

    for path in pair("pycode"):
        r = NativeRunner.from_pretrained(path)
        assert r.vocab_size == 8192 and r.eos_token_ids == frozenset({0}) and r.dtype == torch.float32
        r.prefill([5, 6, 7])
        logits = r.score(TokenTree([8, 9, 10], [-1, 0, 0]))
        assert logits.shape == (3, 8192) and torch.isfinite(logits).all()
    hf = HFRunner(load_model(path, torch.float32, "cpu"))  # the draft: small enough to load twice
    hf.prefill([5, 6, 7])
    assert max_diff(hf.score(TokenTree([8, 9, 10], [-1, 0, 0])), logits) < 1e-4


def test_load_errors(tmp_path):
    with pytest.raises(ValueError, match="no model directory"):
        NativeRunner.from_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="no config.json"):
        NativeRunner.from_pretrained(tmp_path)

    model = build("gqa_tied")
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match="cannot read weights"):
        NativeRunner.from_pretrained(tmp_path)
    weights.unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        NativeRunner.from_pretrained(tmp_path)

    cfg = json.loads((tmp_path / "config.json").read_text())
    for change, reason in (
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type 'yarn'"),
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
        ({"hidden_act": "gelu"}, "activation"),
    ):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=reason):
            NativeRunner.from_pretrained(tmp_path)

    state = build("mha_untied").state_dict()
    del state["lm_head.weight"]
    with pytest.raises(ValueError, match="lacks the tensor 'lm_head.weight'"):
        NativeRunner(LlamaShape.from_config(build("mha_untied").config), state)


def test_unsupported_reason():
    assert unsupported_reason(LlamaConfig()) is None
    assert unsupported_reason(Qwen2Config()) is None
    assert unsupported_reason(MistralConfig(sliding_window=None)) is None
    assert "sliding" in unsupported_reason(MistralConfig(sliding_window=4096))
    assert "sliding" in unsupported_reason(Qwen2Config(use_sliding_window=True, max_window_layers=0))
    assert "mlp_bias" in unsupported_reason(LlamaConfig(mlp_bias=True))
    assert "gpt2" in unsupported_reason({"model_type": "gpt2"})
    assert "dynamic" in unsupported_reason(
        LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    )
    # an older config.json: top-level rope_theta and rope_scaling
    old = dict(model_type="llama", rope_theta=5e5, rope_scaling={"type": "llama3", **LLAMA3_ROPE})
    assert unsupported_reason(old) is None


def test_llama3_inv_freq_equals_hf():
    model = build("llama3_rope")
    assert torch.equal(LlamaShape.from_config(model.config).inv_freq(), model.model.rotary_emb.inv_freq)


# ---- 5. bf16 ------------------------------------------------------------------------------
@pytest.mark.cpu
def test_bf16_close_to_fp32():
    model = build("gqa_tied")
    fp32, bf16 = NativeRunner.from_hf(model), NativeRunner.from_hf(model, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.kv.dtype == torch.bfloat16
    rng = random.Random(6)
    prompt = [rng.randrange(VOCAB) for _ in range(20)]
    for r in (fp32, bf16):
        r.prefill(prompt)
    for _ in range(3):
        tree = random_tree(rng, 9)
        a, b = fp32.score(tree), bf16.score(tree)
        assert b.dtype == torch.bfloat16
        assert (a - b.float()).abs().max() < 0.05 * a.abs().max()
        chain = random_chain(rng, tree)
        for r in (fp32, bf16):
            r.commit(chain)


# ---- 5b. projections ---------------------------------------------------------------------------
needs_packing = pytest.mark.skipif(
    not packing_available(torch.device("cpu"), torch.float32), reason="this torch has no oneDNN packed linear"
)


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_projection_equals_linear_packed_where_onednn_serves_the_dtype(dtype, with_bias):
    """Packed where this CPU's oneDNN serves the dtype (fp32 always; bf16 needs AVX512 BW/VL/DQ
    or AVX-NE-CONVERT), plain BLAS elsewhere: the product equals F.linear's either way."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(600, 512, generator=g).to(dtype)  # 307k elements: packed in fp32 too
    b = torch.randn(600, generator=g).to(dtype) if with_bias else None
    proj = Projection(w, b)
    if packing_available(torch.device("cpu"), dtype):
        assert proj.packed is not None and proj.weight_t is None
    else:
        assert proj.packed is None and proj.weight_t is not None
    for rows in (1, 7, 40):
        x = torch.randn(rows, 512, generator=g).to(dtype)
        want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert (proj(x).double() - want).abs().max() <= tol * want.abs().max()


@pytest.mark.cpu
def test_projection_stays_plain_where_packing_does_not_pay_or_apply():
    w = torch.randn(64, 32)
    assert Projection(w).packed is None  # a small fp32 weight: MKL is faster unpacked
    assert Projection(torch.randn(600, 512), pack=False).packed is None
    w64 = torch.randn(600, 512, dtype=torch.float64)
    plain = Projection(w64)
    assert plain.packed is None and plain.weight_t.data_ptr() == w64.data_ptr()  # a view: F.linear's own call
    x = torch.randn(3, 512, dtype=torch.float64)
    assert torch.equal(plain(x), torch.nn.functional.linear(x, w64))
    # unpacked bf16 (an AVX2-only core) keeps F.linear's layout too: torch's bf16 kernel reads
    # W [out, in] row by row, and through a W^T laid out [in, out] took 17x longer
    w16 = torch.randn(600, 512).bfloat16()
    plain = Projection(w16, pack=False)
    assert plain.weight_t.data_ptr() == w16.data_ptr()
    x = torch.randn(3, 512).bfloat16()
    assert torch.equal(plain(x), torch.nn.functional.linear(x, w16))


@pytest.mark.cpu
@needs_packing
def test_projection_falls_back_when_the_packed_product_is_wrong(monkeypatch):
    """A torch whose private oneDNN op answered differently must not be trusted: the probe at
    construction catches it and the projection multiplies plainly."""
    monkeypatch.setattr(linear, "_packed_product", lambda x, packed, bias: torch.zeros(x.shape[0], 600))
    w = torch.randn(600, 512)
    proj = Projection(w)
    assert proj.packed is None
    x = torch.randn(2, 512)
    assert torch.allclose(proj(x), x @ w.t(), rtol=1e-5, atol=1e-4)


# ---- 6. the flash cascade's math on CPU -----------------------------------------------------
@pytest.mark.cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_path_matches_sdpa(dtype):
    model = build("gqa_tied")
    plain, cascade = NativeRunner.from_hf(model, dtype=dtype), NativeRunner.from_hf(model, dtype=dtype)
    cascade.flash, cascade.prefix_attention = True, reference_prefix_attention  # what CUDA runs, by reference
    rng = random.Random(7)
    prompt = [rng.randrange(VOCAB) for _ in range(10)]
    for r in (plain, cascade):
        r.prefill(prompt)
    tol = 1e-5 if dtype == torch.float32 else 0.05
    for _ in range(6):
        tree = random_tree(rng, rng.randint(2, 10))
        a, b = plain.score(tree), cascade.score(tree)
        assert max_diff(a, b) < tol * max(1.0, a.abs().max().item())
        chain = random_chain(rng, tree)
        for r in (plain, cascade):
            r.commit(chain)


# ---- 7. cache growth ------------------------------------------------------------------------
def test_capacity_growth_matches_hf(monkeypatch):
    monkeypatch.setattr(kv, "INITIAL_CAPACITY", 8)
    model = build("llama3_rope", max_positions=64)
    hf, nat = runners(model)
    assert nat.capacity == 8
    rng = random.Random(8)
    prompt = [rng.randrange(VOCAB) for _ in range(13)]  # past the first capacity at once
    for r in (hf, nat):
        r.prefill(prompt)
    caps = {nat.capacity}
    while nat.n_committed < 56:
        tree = random_tree(rng, 7)
        assert max_diff(hf.score(tree), nat.score(tree)) < 1e-4
        chain = tree.path_to(len(tree) - 1)
        for r in (hf, nat):
            r.commit(chain)
        caps.add(nat.capacity)
    assert len(caps) >= 3 and nat.capacity <= 64 + 7
    # a wide tree at the end: more slots than positions, still fine
    tree = TokenTree([rng.randrange(VOCAB) for _ in range(12)], [-1] + [0] * 11)
    assert max_diff(hf.score(tree), nat.score(tree)) < 1e-4


# ---- CUDA (skipped without a GPU) ---------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_hf(dtype):
    model = build("gqa_tied").to("cuda", dtype)
    hf, nat = runners(model)
    assert nat.device.type == "cuda" and nat.kv.is_cuda
    rng = random.Random(9)
    prompt = [rng.randrange(VOCAB) for _ in range(20)]
    for r in (hf, nat):
        r.prefill(prompt)
    for _ in range(5):
        tree = random_tree(rng, 9)
        a, b = hf.score(tree).float(), nat.score(tree).float()
        assert (a - b).abs().max() < (1e-4 if dtype == torch.float32 else 0.05 * a.abs().max())
        chain = random_chain(rng, tree)
        for r in (hf, nat):
            r.commit(chain)


# ---- 8. the forward's building blocks, the SmolLM2 shape ---------------------------------------
# SmolLM2-135M's layout (30 layers, 9 query / 3 kv heads, tied embeddings, RoPE theta 1e5) at a
# tiny width: hidden 72 = 9 heads x head_dim 8
SMOLLM2_SHAPED = dict(
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    hidden_size=72,
    intermediate_size=64,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rms_norm_is_hf_bit_for_bit(dtype):
    """`rms_norm` skips the float32 round trip for float32 and bf16 (F.rms_norm computes in
    float32 for them) and keeps it for float64: HF's LlamaRMSNorm, bit for bit, in all three."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    hf = LlamaRMSNorm(72, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(72, generator=g) * 0.3 + 1)
    for rows in (1, 7, 130):
        x = (torch.randn(rows, 72, generator=g) * 4).to(dtype)
        assert torch.equal(rms_norm(x, hf.weight.detach(), 1e-5), hf(x).detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_fused_qkv_rotation_leaves_v_exact(dtype):
    """RoPE on the whole fused q/k/v output (`rope_rows` + `rotate`): q and k rotated exactly as
    with [T, 1, D] tables, v heads (cos 1, sin 0) bit for bit unchanged."""
    model = build("gqa_tied", **SMOLLM2_SHAPED)
    shape = LlamaShape.from_config(model.config)
    runner = NativeRunner(shape, model.state_dict(), dtype=dtype)
    Hq, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    positions = torch.tensor([0, 3, 3, 40, 129])
    qkv = torch.randn(5, Hq + 2 * Hkv, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    cos, sin = rope_rows(runner.pool.cos, runner.pool.sin_signed, positions, shape)
    assert cos.shape == sin.shape == (5, Hq + 2 * Hkv, D)
    got = rotate(qkv, cos, sin)
    want_qk = rotate(
        qkv[:, : Hq + Hkv], runner.pool.cos[positions][:, None], runner.pool.sin_signed[positions][:, None]
    )
    assert torch.equal(got[:, : Hq + Hkv], want_qk)
    assert torch.equal(got[:, Hq + Hkv :], qkv[:, Hq + Hkv :])


@pytest.mark.cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_smollm2_shaped_matches_hf(dtype):
    """The forward on SmolLM2's layout (30 layers, 9/3 heads, tied): one lane and two packed
    lanes, trees, commits that move slots, a drafting step; HF's logits to 1e-4 / 1e-9."""
    model = build("gqa_tied", dtype, **SMOLLM2_SHAPED)
    hf, nat = runners(model)
    assert nat.shape.layers == 30 and (nat.shape.heads, nat.shape.kv_heads) == (9, 3) and nat.shape.tied
    rng = random.Random(12)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (13, 6)]
    hfs, lanes = [HFRunner(model) for _ in range(2)], nat.lanes(2)
    prefill_many(list(zip(hfs, prompts)))
    prefill_many(list(zip(lanes, prompts)))
    hf.prefill(prompts[0])
    nat.prefill(prompts[0])
    for size in (1, 5, 17):
        tree = random_tree(rng, size)
        assert max_diff(hf.score(tree), nat.score(tree)) < TOL[dtype]
        trees = [tree, random_tree(rng, 3)]
        for want, got in zip(logits_many(hfs, trees), logits_many(lanes, trees)):
            assert max_diff(want, got) < TOL[dtype]
        chain = random_chain(rng, tree)
        for r in (hf, nat, hfs[0], lanes[0]):
            r.commit(chain)
        for r in (hfs[1], lanes[1]):
            r.commit([0])
        toks, parents = [rng.randrange(VOCAB) for _ in range(3)], [-1, 0, 1]  # a drafting step
        assert max_diff(hf.extend(toks, parents), nat.extend(toks, parents)) < TOL[dtype]
        for r in (hf, nat):
            r.commit([0, 1])


# ---- 9. the compiled forward (compile=True) -----------------------------------------------------
# Compiling takes tens of seconds even for a 2-layer model: the default run compiles one small
# model with inductor's cheapest settings; the SmolLM2- and Llama-3.2-shaped models with the
# settings the library uses are slow tests.
def unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def drive(hf, nat, rng, rounds: int, tol: float) -> None:
    """Decode steps, trees, moved and in-order commits and drafting steps, checking every forward
    against `hf` (an HF runner, or an eager native runner) and the caches' bookkeeping."""
    for _ in range(rounds):
        one = TokenTree([rng.randrange(VOCAB)], [-1])
        assert max_diff(hf.score(one), nat.score(one)) < tol  # the decode step: the n = 1 graph
        for r in (hf, nat):
            r.commit([0])
        tree = random_tree(rng, rng.randint(2, 12))
        assert max_diff(hf.score(tree), nat.score(tree)) < tol  # the 2..64 graph
        chain = random_chain(rng, tree)
        for r in (hf, nat):
            r.commit(chain)
        toks, parents = [rng.randrange(VOCAB) for _ in range(2)], [-1, 0]
        assert max_diff(hf.extend(toks, parents), nat.extend(toks, parents)) < tol
        toks, parents = [rng.randrange(VOCAB)], [0]  # node 1's sibling: a masked single node
        assert max_diff(hf.extend(toks, parents), nat.extend(toks, parents)) < tol
        for r in (hf, nat):
            r.commit([0, 2])
        assert hf.committed == nat.committed and nat.filled == nat.n_committed


@pytest.mark.cpu
def test_compiled_forward_matches_hf(monkeypatch):
    """One graph per feed size up to COMPILE_STATIC_MAX (2 here: three graphs to compile, not
    nine) and one for larger feeds serve every forward with logits of 1..64 tokens, through
    cache growth (8 slots at first, here) without recompiling; prefills and packed lanes run
    eagerly; HF's logits."""
    monkeypatch.setattr(kv, "INITIAL_CAPACITY", 8)
    monkeypatch.setattr(native_compile, "COMPILE_STATIC_MAX", 2)
    model = build("gqa_tied")
    hf, nat = HFRunner(model), compiled_runner(model, CHEAP)
    assert all(p.packed is None for p in projections(nat))  # the graphs pack their own copies
    rng = random.Random(13)
    prompt = [rng.randrange(VOCAB) for _ in range(11)]
    for r in (hf, nat):
        r.prefill(prompt)  # no logits: eager
    before = unique_graphs()
    drive(hf, nat, rng, rounds=4, tol=1e-4)
    assert nat.capacity >= 32 and not nat.compiled.failed
    graphs = unique_graphs() - before  # one per size seen, whatever the span and capacity
    assert graphs == native_compile.COMPILE_STATIC_MAX + 1  # sizes 1, 2 and the dynamic graph
    assert graphs == len(nat.compiled.compiled)  # none recompiled: called unmarked, the grown cache too
    long = TokenTree([rng.randrange(VOCAB) for _ in range(70)], [-1] + list(range(69)))  # > 64: eager
    assert max_diff(hf.score(long), nat.score(long)) < 1e-4
    hfs, lanes = [HFRunner(model) for _ in range(2)], nat.lanes(2)  # a pool of two rows: eager
    prefill_many(list(zip(hfs, [prompt, prompt[:5]])))
    prefill_many(list(zip(lanes, [prompt, prompt[:5]])))
    trees = [random_tree(rng, 6), random_tree(rng, 1)]
    for want, got in zip(logits_many(hfs, trees), logits_many(lanes, trees)):
        assert max_diff(want, got) < 1e-4
    assert unique_graphs() - before == graphs  # long feeds and pooled lanes ran eagerly


@pytest.mark.cpu
def test_a_cache_grown_while_decoding_recompiles_no_graph(monkeypatch):
    """The pool is made outside inference mode and grows inside it (forwards run under
    `torch.inference_mode`): its tensors must stay ordinary ones, or every graph compiled
    before the growth recompiles for the new dispatch keys, and past dynamo's recompile limit
    the graph's code runs eagerly (the compiled pycode pair decoded at half eager's speed)."""
    monkeypatch.setattr(kv, "INITIAL_CAPACITY", 8)
    model = build("gqa_tied")
    nat, eager = compiled_runner(model, CHEAP), NativeRunner.from_hf(model)
    rng = random.Random(5)
    prompt = [rng.randrange(VOCAB) for _ in range(3)]
    for r in (nat, eager):
        r.prefill(prompt)
    one = lambda: TokenTree([rng.randrange(VOCAB)], [-1])  # noqa: E731
    for step in range(20):  # past 8 slots: the pool grows inside a forward
        tree = one()
        assert max_diff(eager.score(tree), nat.score(tree)) < 1e-4
        for r in (nat, eager):
            r.commit([0])
        if step == 0:
            before = unique_graphs()  # the n = 1 graph, compiled before the growth
    assert nat.capacity > 8 and unique_graphs() == before and not nat.compiled.failed


@pytest.mark.cpu
def test_compiled_forward_returns_the_taps_features_and_keeps_graphs_per_taps():
    """A compiled target tapped for a feature head returns the eager forward's features with its
    logits; switching taps back and forth (decoders with and without a head sharing one runner)
    reuses each set of graphs instead of recompiling."""
    model = build("gqa_tied")
    eager, nat = NativeRunner.from_hf(model), compiled_runner(model, CHEAP)
    for r in (eager, nat):
        r.set_taps((0, 2))
        r.prefill([3, 1, 4, 1, 5])
    plain_graphs = nat._graphs_by_taps[()]
    tree = TokenTree([9], [-1])
    want, got = (score_many([(r, tree)])[0] for r in (eager, nat))
    assert max_diff(want.logits, got.logits) < 1e-4 and max_diff(want.features, got.features) < 1e-4
    assert 1 in nat.compiled.compiled  # the one-token graph served it
    tapped = nat.compiled
    nat.set_taps(())
    assert nat.compiled is plain_graphs
    nat.set_taps((0, 2))
    assert nat.compiled is tapped


def test_compiled_forward_falls_back_to_eager(monkeypatch):
    model = build("gqa_tied")
    eager, nat = NativeRunner.from_hf(model), compiled_runner(model, CHEAP)

    def broken(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(nat.compiled, "graph", broken)
    for r in (eager, nat):
        r.prefill([3, 1, 4, 1, 5])
    tree = TokenTree([9, 2, 6], [-1, 0, 0])
    with pytest.warns(UserWarning, match="compiled forward failed .*no C\\+\\+ compiler.*running eagerly"):
        got = nat.score(tree)
    assert nat.compiled.failed and max_diff(eager.score(tree), got) < 1e-5
    for r in (eager, nat):
        r.commit([0])
    monkeypatch.setattr(nat.compiled, "graph", lambda *a: pytest.fail("a failed graph is not tried again"))
    assert max_diff(eager.score(tree), nat.score(tree)) < 1e-5


def test_compiled_runners_keep_their_own_graphs(monkeypatch):
    """dynamo keeps graphs, and counts its recompile limit, per code object: each runner's
    graphs live under a forward of its own, so two compiled runners (a target and its draft,
    two dtypes) do not exhaust one shared limit. They did: with the SmolLM2 pair, trees at T=1
    met new feed sizes after the limit and the target fell back to its eager forward."""
    monkeypatch.setattr(CompiledForward, "DYNAMO", {**CompiledForward.DYNAMO, "recompile_limit": 2})
    model = build("gqa_tied")
    eager, runners = NativeRunner.from_hf(model), [compiled_runner(model, CHEAP) for _ in range(2)]
    for r in [eager, *runners]:
        r.prefill([3, 1, 4, 1, 5])
    for n in (1, 2):  # two sizes per runner: four graphs in all, two under each limit
        tree = TokenTree(list(range(2, 2 + n)), [-1] + [0] * (n - 1))
        want = eager.score(tree)
        eager.commit([])
        for r in runners:
            got = r.score(tree)
            r.commit([])
            assert max_diff(want, got) < 1e-4
    assert not any(r.compiled.failed for r in runners)


def test_compile_unsupported_is_ignored_with_a_warning():
    assert compile_unsupported_reason(torch.device("cpu"), torch.float32) is None
    assert compile_unsupported_reason(torch.device("cpu"), torch.bfloat16) is None
    assert "CPU only" in compile_unsupported_reason(torch.device("cuda"), torch.bfloat16)
    assert "float64" in compile_unsupported_reason(torch.device("cpu"), torch.float64)
    model = build("gqa_tied", torch.float64)
    with pytest.warns(UserWarning, match="compile=True ignored"):
        nat = NativeRunner.from_hf(model, compile=True)
    assert nat.compiled is None
    hf = HFRunner(model)
    for r in (hf, nat):
        r.prefill([1, 2, 3])
    assert max_diff(hf.score(TokenTree([4, 5], [-1, 0])), nat.score(TokenTree([4, 5], [-1, 0]))) < 1e-9


@pytest.mark.cpu
@pytest.mark.slow
def test_compiled_smollm2_shaped():
    """The library's settings (max-autotune GEMMs) on SmolLM2's layout: float32 against HF, and
    bf16 against the eager bf16 forward (fused kernels round bf16 differently, nothing more)."""
    model = build("gqa_tied", **SMOLLM2_SHAPED)
    hf, nat = HFRunner(model), compiled_runner(model)
    rng = random.Random(14)
    prompt = [rng.randrange(VOCAB) for _ in range(9)]
    for r in (hf, nat):
        r.prefill(prompt)
    drive(hf, nat, rng, rounds=3, tol=1e-4)
    eager, comp = (NativeRunner.from_hf(model, dtype=torch.bfloat16, compile=c) for c in (False, True))
    for r in (eager, comp):
        r.prefill(prompt)
    for _ in range(3):
        tree = random_tree(rng, 7)
        a, b = eager.score(tree).float(), comp.score(tree).float()
        assert (a - b).abs().max() < 0.05 * a.abs().max()
        chain = random_chain(rng, tree)
        for r in (eager, comp):
            r.commit(chain)


@pytest.mark.slow
def test_compiled_llama32_1b_shaped():
    """Llama-3.2-1B's shape (one layer), compiled with the library's settings: HF's logits."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=1,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters=dict(LLAMA3_ROPE, factor=32.0, original_max_position_embeddings=8192),
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    hf, nat = HFRunner(model), compiled_runner(model)
    rng = random.Random(15)
    prompt = [rng.randrange(128256) for _ in range(20)]
    for r in (hf, nat):
        r.prefill(prompt)
    for tree in (
        TokenTree([rng.randrange(128256)], [-1]),
        TokenTree([5, 6, 7, 8, 9, 10], [-1, 0, 0, 1, 1, 2]),
    ):
        assert max_diff(hf.score(tree), nat.score(tree)) < 1e-4
        for r in (hf, nat):
            r.commit([0])
