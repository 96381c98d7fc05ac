"""Bad input fails early with a ValueError that says what to fix, and breaks nothing."""

from __future__ import annotations

import pytest
import torch

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig

from .conftest import tiny_llama


@pytest.fixture(scope="module")
def dec():
    return SpeculativeDecoder(
        tiny_llama(0, max_positions=64), tiny_llama(1, hidden=16, layers=1, heads=2, kv_heads=1)
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(width=0), "width must be an integer >= 1"),
        (dict(depth=0), "depth must be an integer >= 1"),
        (dict(depth=2.5), "depth must be an integer"),
        (dict(strategy="beam"), "strategy must be one of"),
    ],
)
def test_invalid_tree_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TreeConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.5), "temperature must be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(top_k=-1), "top_k must be None or an integer >= 0"),
        (dict(repetition_penalty=0), "repetition_penalty must be a finite number > 0"),
        (dict(repetition_penalty=-1.2), "repetition_penalty must be a finite number > 0"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number > 0"),
        (dict(repetition_penalty=True), "repetition_penalty must be a finite number > 0"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty must be a finite number"),
        (dict(presence_penalty="0.5"), "presence_penalty must be a finite number"),
    ],
)
def test_invalid_sampling_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


def test_vocabularies_must_match():
    with pytest.raises(ValueError, match="vocabularies differ"):
        SpeculativeDecoder(tiny_llama(0), tiny_llama(1, vocab=100))


@pytest.mark.parametrize("prompt", [[], ""])
def test_empty_prompt(dec, prompt):
    with pytest.raises(ValueError, match="empty|tokenizer"):
        dec.generate(prompt, 4)


def test_empty_text_prompt_with_tokenizer(dec):
    class Tok:  # a tokenizer that, like most, returns no ids for ""
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) % 90 for c in text]}

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)

    d = SpeculativeDecoder(dec.target_runner, dec.draft_runner, tokenizer=Tok())
    with pytest.raises(ValueError, match="prompt is empty"):
        d.generate("", 4)


def test_text_prompt_needs_a_tokenizer(dec):
    with pytest.raises(ValueError, match="needs a tokenizer"):
        dec.generate("def f():", 4)


def test_prompt_plus_new_tokens_beyond_positions(dec):
    with pytest.raises(ValueError, match="exceeds the target model's 64 positions"):
        dec.generate([3] * 60, 10)
    with pytest.raises(ValueError, match=r"the prompt \(64 tokens\) fills the target model's 64 positions"):
        dec.generate([3] * 64, 1)


def test_token_ids_outside_vocabulary(dec):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dec.generate([3, 500], 4)


@pytest.mark.parametrize("n", [0, -3, 2.0])
def test_max_new_tokens(dec, n):
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate([3, 4], n)


def test_tree_needs_a_draft_model():
    """A fixed tree without a draft model is an error; the automatic tree decodes plainly."""
    dec = SpeculativeDecoder(tiny_llama(0))
    with pytest.raises(ValueError, match="needs a draft model"):
        dec.generate([3, 4], 4, tree=TreeConfig(1, 2))
    out = dec.generate([3, 4], 4, tree=TreeConfig())
    assert out.plan == "auto: plain decoding (no draft model)" and out.stats.tree_nodes == 0


def test_config_objects_are_type_checked(dec):
    with pytest.raises(ValueError, match="SamplingConfig"):
        dec.generate([3, 4], 4, sampling={"temperature": 0})
    with pytest.raises(ValueError, match="TreeConfig"):
        dec.generate([3, 4], 4, tree=(4, 2))


@pytest.mark.parametrize("who", ["target", "draft"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_logits_raise_and_leave_the_decoder_usable(who, temperature):
    target, draft = tiny_llama(0), tiny_llama(1, hidden=16, layers=1, heads=2, kv_heads=1)
    dec = SpeculativeDecoder(target, draft)
    broken = target if who == "target" else draft
    w = broken.model.norm.weight
    saved = w.detach().clone()
    with torch.no_grad():
        w[0] = float("nan")
    with pytest.raises(ValueError, match=f"{who} model produced NaN"):
        dec.generate(
            [3, 4, 5], 8, tree=TreeConfig(2, 2), sampling=SamplingConfig(temperature=temperature), seed=0
        )
    with torch.no_grad():
        w.copy_(saved)
    out = dec.generate(
        [3, 4, 5],
        8,
        tree=TreeConfig(2, 2),
        sampling=SamplingConfig(temperature=temperature),
        seed=0,
        ignore_eos=True,
    )
    assert len(out.token_ids) == 8


def test_unknown_model_path():
    with pytest.raises(ValueError, match="no model at '/nonexistent/model'"):
        SpeculativeDecoder.from_pretrained(target="/nonexistent/model", draft="/nonexistent/draft")


def test_unknown_dtype(tmp_path):
    with pytest.raises(ValueError, match="unknown dtype"):
        SpeculativeDecoder.from_pretrained(target=tmp_path, draft=tmp_path, dtype="float99")


# ---- issue 11, item 7: every bad input a one-line ValueError saying what to change ------------
def _corrupt_copy(tmp_path, how: str):
    """A copy of the bundled draft checkpoint with its weights truncated or overwritten."""
    import shutil

    from treespec.zoo import pair

    dst = tmp_path / f"draft-{how}"
    shutil.copytree(pair("pycode")[1], dst)
    f = dst / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(
        data[: len(data) // 2] if how == "truncated" else b"\x08" + b"\x00" * 7 + b"not json" + data[16:]
    )
    return dst


def _from_pretrained(**kw):
    return lambda dec, tmp_path: SpeculativeDecoder.from_pretrained(**kw)


def _gen(prompt=(3, 4), n=4, **kw):
    return lambda dec, tmp_path: dec.generate(list(prompt) if isinstance(prompt, tuple) else prompt, n, **kw)


def _corrupt(how, backend):
    def run(dec, tmp_path):
        path = _corrupt_copy(tmp_path, how)
        SpeculativeDecoder.from_pretrained(target=path, draft=path, backend=backend)

    return run


BAD_INPUTS = [
    # huge trees: rejected on construction with the limit in the message, nothing allocated
    ("huge width", lambda dec, tmp: TreeConfig(width=10**6, depth=4), "the limit is 1024"),
    ("huge depth", lambda dec, tmp: TreeConfig(width=1, depth=10**9), "the limit is 1024"),
    (
        "huge budget",
        lambda dec, tmp: TreeConfig(width=4, depth=4, strategy="dynamic", budget=10**6),
        "the limit is 1024",
    ),
    (
        "huge beam",
        lambda dec, tmp: TreeConfig(width=64, depth=3, strategy="without_replacement"),
        "the limit is 1024",
    ),
    (
        "huge adaptive depth",
        lambda dec, tmp: TreeConfig(width=4, depth=4, adaptive="hf", depth_max=10**5),
        "the limit is 1024",
    ),
    # temperatures so small that logits / temperature overflows
    ("temperature 1e-40", lambda dec, tmp: SamplingConfig(temperature=1e-40), r"so small .* >= 1e-06"),
    ("temperature 1e-300", lambda dec, tmp: SamplingConfig(temperature=1e-300), "use temperature=0"),
    # token ids of the wrong type: refused, never converted
    ("bytes prompt", _gen(b"\x03\x04"), "the prompt is bytes"),
    ("float ids", _gen((3.0, 4.0)), r"must be ints, got 3.0 \(float\)"),
    ("bool ids", _gen((True, False)), r"must be ints, got True \(bool\)"),
    ("string ids", _gen(("3", "4")), r"must be ints, got '3' \(str\)"),
    ("float tensor", _gen(torch.tensor([3.0, 4.0])), "must be integers, got an array of torch.float32"),
    ("2-D tensor", _gen(torch.tensor([[3, 4]])), r"must be 1-D token ids, got shape \(1, 2\)"),
    ("int prompt", _gen(7), "must be text, a chat or a list of int token ids, got int"),
    # seeds
    ("fractional seed", _gen(seed=2.5), r"seed must be None or an integer in \[0, 2\*\*64\), got 2.5"),
    ("huge seed", _gen(seed=2**64), r"seed must be None or an integer in \[0, 2\*\*64\)"),
    ("negative seed", _gen(seed=-1), r"seed must be None or an integer in \[0, 2\*\*64\), got -1"),
    ("bool seed", _gen(seed=True), "seed must be None or an integer"),
    # a path (or None) where a model goes
    (
        "path as target",
        lambda dec, tmp: SpeculativeDecoder("models/llama", dec.draft_runner),
        r"target is a path .*from_pretrained",
    ),
    (
        "path as draft",
        lambda dec, tmp: SpeculativeDecoder(dec.target_runner, tmp),
        r"draft is a path .*from_pretrained",
    ),
    ("None as target", lambda dec, tmp: SpeculativeDecoder(None, dec.draft_runner), "target is None"),
    (
        "int as draft",
        lambda dec, tmp: SpeculativeDecoder(dec.target_runner, 3),
        "expected a Hugging Face causal LM or a treespec Runner, got int",
    ),
    (
        "tokenizer without decode",
        lambda dec, tmp: SpeculativeDecoder(dec.target_runner, tokenizer=len),
        "tokenizer must be a Hugging Face tokenizer",
    ),
    (
        "path as tokenizer",
        lambda dec, tmp: SpeculativeDecoder(dec.target_runner, tokenizer="tok/"),
        "tokenizer is a path",
    ),
    (
        "model to from_pretrained",
        lambda dec, tmp: SpeculativeDecoder.from_pretrained(target=dec.target_runner, draft=None),
        "takes paths or hub ids",
    ),
    ("on_tokens not callable", _gen(on_tokens="print"), "on_tokens must be a function"),
    ("rng not an Rng", _gen(rng=42), "rng must be a treespec.rng.Rng"),
    (
        "ema_beta a string",
        lambda dec, tmp: TreeConfig(adaptive="entropy", ema_beta="0.5"),
        "ema_beta must be in",
    ),
    (
        "speculate-or-not given as a depth policy",
        lambda dec, tmp: TreeConfig(width=1, depth=2, adaptive="goodput"),
        "plain_fallback=True",
    ),
    (
        "plain_fallback a string",
        lambda dec, tmp: TreeConfig(width=1, depth=2, plain_fallback="yes"),
        "plain_fallback must be True or False",
    ),
    ("unknown drafter to from_pretrained", _from_pretrained(drafter="eagle"), "drafter must be one of"),
    # devices that do not exist here
    ("device npu", _from_pretrained(device="npu"), "unknown device 'npu'"),
    ("device foo:0", _from_pretrained(device="foo:0"), "unknown device 'foo:0'"),
    ("device float", _from_pretrained(device=0.5), "device must be a string"),
    # relative paths that look like paths: never retried as hub ids
    (
        "missing relative path",
        _from_pretrained(target="treespec/zoo/nothere", draft="treespec/zoo/nothere"),
        r"no model at 'treespec/zoo/nothere': .* does not exist",
    ),
    ("missing nested path", _from_pretrained(target="a/b/c", draft="a/b/c"), "no model at 'a/b/c'"),
    (
        "file, not a directory",
        _from_pretrained(target="pyproject.toml", draft="pyproject.toml"),
        "no model at 'pyproject.toml': expected a directory",
    ),
    (
        "path with ..",
        _from_pretrained(target="../nothere", draft="../nothere"),
        r"no model at '\.\./nothere'",
    ),
    # broken checkpoints
    (
        "truncated safetensors, native",
        _corrupt("truncated", "native"),
        "cannot read weights from .*model.safetensors",
    ),
    (
        "truncated safetensors, hf",
        _corrupt("truncated", "hf"),
        "cannot load a causal LM from .*intact weights",
    ),
    (
        "corrupted safetensors, native",
        _corrupt("garbage", "native"),
        "cannot read weights from .*model.safetensors",
    ),
    ("corrupted safetensors, hf", _corrupt("garbage", "hf"), "cannot load a causal LM from"),
]
if not torch.cuda.is_available():
    BAD_INPUTS += [
        (
            "device cuda without a GPU",
            _from_pretrained(device="cuda"),
            "device 'cuda' is not available on this machine",
        ),
        (
            "device cuda:7 without a GPU",
            _from_pretrained(device="cuda:7"),
            "device 'cuda:7' is not available",
        ),
    ]
else:
    BAD_INPUTS += [
        (
            "device cuda:N beyond the GPUs",
            _from_pretrained(device=f"cuda:{torch.cuda.device_count()}"),
            "this machine has",
        )
    ]


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_a_one_line_value_error(case, dec, tmp_path):
    _, call, match = case
    with pytest.raises(ValueError, match=match) as e:
        call(dec, tmp_path)
    assert "\n" not in str(e.value)


def test_model_free_drafters_ignore_the_draft_models_context_limit():
    short_draft = tiny_llama(1, hidden=16, layers=1, heads=2, kv_heads=1, max_positions=16)
    for drafter in ("ngram", "lookup"):
        d = SpeculativeDecoder(tiny_llama(0), short_draft, drafter=drafter)
        assert len(d.generate([3, 4, 5] * 5, 8, tree=TreeConfig(2, 3), ignore_eos=True).token_ids) == 8
    with pytest.raises(ValueError, match="exceeds the draft model's 16 positions"):
        SpeculativeDecoder(tiny_llama(0), short_draft).generate([3, 4, 5] * 5, 8)


def test_integer_arrays_are_token_ids(dec):
    import numpy as np

    kw = dict(sampling=SamplingConfig(temperature=0.7), ignore_eos=True, seed=2**64 - 1)
    ref = dec.generate([3, 4, 5], 4, **kw).token_ids
    assert dec.generate(torch.tensor([3, 4, 5]), 4, **kw).token_ids == ref
    assert dec.generate(np.array([3, 4, 5]), 4, **kw).token_ids == ref
