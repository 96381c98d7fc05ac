"""Bad input fails early with a ValueError that says what to fix, and breaks nothing."""

from __future__ import annotations

import pytest
import torch

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig

from .conftest import tiny_llama


@pytest.fixture(scope="module")
def dec():
    return SpeculativeDecoder(tiny_llama(0, max_positions=64), tiny_llama(1, hidden=16, layers=1, heads=2, kv_heads=1))


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

    d = SpeculativeDecoder(dec.target_runner, dec.draft_runner, tokenizer=Tok())
    with pytest.raises(ValueError, match="prompt is empty"):
        d.generate("", 4)


def test_text_prompt_needs_a_tokenizer(dec):
    with pytest.raises(ValueError, match="needs a tokenizer"):
        dec.generate("def f():", 4)


def test_prompt_plus_new_tokens_beyond_positions(dec):
    with pytest.raises(ValueError, match="exceeds the target model's 64 positions"):
        dec.generate([3] * 60, 10)


def test_token_ids_outside_vocabulary(dec):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dec.generate([3, 500], 4)


@pytest.mark.parametrize("n", [0, -3, 2.0])
def test_max_new_tokens(dec, n):
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate([3, 4], n)


def test_tree_needs_a_draft_model():
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeDecoder(tiny_llama(0)).generate([3, 4], 4, tree=TreeConfig())


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
        dec.generate([3, 4, 5], 8, tree=TreeConfig(2, 2), sampling=SamplingConfig(temperature=temperature), seed=0)
    with torch.no_grad():
        w.copy_(saved)
    out = dec.generate([3, 4, 5], 8, tree=TreeConfig(2, 2), sampling=SamplingConfig(temperature=temperature), seed=0, ignore_eos=True)
    assert len(out.token_ids) == 8


def test_unknown_model_path():
    with pytest.raises(ValueError, match="no model at '/nonexistent/model'"):
        SpeculativeDecoder.from_pretrained(target="/nonexistent/model", draft="/nonexistent/draft")


def test_unknown_dtype(tmp_path):
    with pytest.raises(ValueError, match="unknown dtype"):
        SpeculativeDecoder.from_pretrained(target=tmp_path, draft=tmp_path, dtype="float99")
