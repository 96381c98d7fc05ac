"""Structured outputs through every front end, on the bundled pycode pair: the Python API
(generate, generate_batch), the CLI and the server (OpenAI's response_format, vLLM's
structured_outputs, tool calls); bad constraints refused before any work."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.cli import main
from treespec.constraints import Choice, Grammar, JsonObject, JsonSchema, Regex, constraint_from
from treespec.zoo import ZOO

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "status": {"enum": ["open", "closed", "pending"]},
            "score": {"type": "number"},
            "owner": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "email": {"type": "string", "format": "email"}},
                "required": ["id"],
                "additionalProperties": False,
            },
            "note": {"type": "string", "maxLength": 10},
        },
        "required": ["status", "score", "owner"],
        "additionalProperties": False,
    },
]
REGEX = r"[0-9]{3}-[0-9]{4}"
BAD = {"type": "objekt"}


@pytest.fixture(scope="module")
def dec():
    return SpeculativeDecoder.from_pretrained(
        target=ZOO / "pycode" / "target", draft=ZOO / "pycode" / "draft", dtype="float32"
    )


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


# ---- constraints as data --------------------------------------------------------------------
@pytest.mark.parametrize(
    "make,words",
    [
        (lambda: Regex("[a-"), "invalid regex"),
        (lambda: JsonSchema({"type": "objekt"}), "invalid JSON schema"),
        (lambda: JsonSchema("{not json"), "not valid JSON"),
        (lambda: Grammar("start: foo"), "invalid lark grammar"),
        (lambda: Grammar("root ::= foo", "gbnf"), "invalid GBNF"),
        (lambda: Choice(()), "choice"),
        (lambda: constraint_from({"regex": "a", "choice": ["b"]}), "exactly one"),
        (lambda: constraint_from(3), "constraint must be"),
    ],
)
def test_bad_constraints_are_value_errors(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_constraint_from_reads_every_form():
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: int

    assert isinstance(constraint_from(Point), JsonSchema)
    assert isinstance(constraint_from({"json": "object"}), JsonObject)
    assert isinstance(constraint_from({"json_schema": SCHEMAS[0]}), JsonSchema)
    assert constraint_from({"choice": ["a", "b"]}) == Choice(("a", "b"))
    assert constraint_from({"grammar": 'root ::= "x"'}).syntax == "gbnf"


# ---- the Python API -------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("tree", [None, TreeConfig(), TreeConfig(2, 3, "without_replacement")], ids=str)
def test_outputs_validate_plain_and_speculative(dec, tree, temperature):
    for i, schema in enumerate(SCHEMAS):
        out = dec.generate(
            "record = ", 96, tree=tree, sampling=SamplingConfig(temperature=temperature), seed=i,
            constraint=JsonSchema(schema),
        )  # fmt: skip
        assert out.finish_reason in ("eos", "length")
        assert out.finish_reason == "length" or valid(out.text, schema), out.text
    out = dec.generate(
        "x = ", 16, tree=tree, sampling=SamplingConfig(temperature=temperature), constraint=Regex(REGEX)
    )
    assert out.finish_reason == "eos" and len(out.text) == 8 and out.text[3] == "-"


def test_greedy_speculative_equals_greedy_plain_under_the_constraint(dec):
    for schema in SCHEMAS:
        c = JsonSchema(schema)
        plain = dec.generate("item = ", 64, tree=None, sampling=SamplingConfig(temperature=0), constraint=c)
        for tree in (TreeConfig(), TreeConfig(1, 4), TreeConfig(3, 3, "topk")):
            spec = dec.generate(
                "item = ", 64, tree=tree, sampling=SamplingConfig(temperature=0), constraint=c
            )
            assert spec.token_ids == plain.token_ids
            assert spec.stats.forced_accepted > 0  # keys, quotes and braces drafted for free


def test_a_greedy_request_the_plan_leaves_undrafted_drafts_by_prompt_lookup(dec, monkeypatch):
    """Where the automatic tree's plan is below DRAFTER_MIN_SPEEDUP, a constrained request
    drafts a chain by prompt lookup (no draft forward) above its forced tokens, from matches of
    one token greedy and of two sampled; greedy output equals greedy plain token for token."""
    monkeypatch.setattr("treespec.engine.DRAFTER_MIN_SPEEDUP", float("inf"))  # every plan is below it
    prompt = 'record = {"name": "Ann", "age": 7, "tags": ["a"]}\nrecord = '
    for schema in SCHEMAS:
        c, greedy = JsonSchema(schema), SamplingConfig(temperature=0)
        plain = dec.generate(prompt, 64, tree=None, sampling=greedy, constraint=c)
        spec = dec.generate(prompt, 64, tree=TreeConfig(), sampling=greedy, constraint=c)
        assert "a chain of 4 by lookup" in spec.plan and "from 1-token matches" in spec.plan
        assert spec.verification == "block"
        assert spec.token_ids == plain.token_ids and spec.stats.draft_forwards == 0
        assert spec.stats.accepted_tokens > spec.stats.forced_accepted  # lookup's own tokens too
        sampled = dec.generate(
            prompt, 64, tree=TreeConfig(), sampling=SamplingConfig(temperature=1), constraint=c
        )
        assert "a chain of 4 by lookup" in sampled.plan and "from 2-token matches" in sampled.plan
        assert sampled.verification == "block" and sampled.stats.draft_forwards == 0
        assert sampled.finish_reason == "length" or valid(sampled.text, schema)


def test_lookup_proposes_no_token_the_grammar_forbids(dec):
    """A model-free drafter under a constraint cuts each path before the first token its
    grammar forbids: such a node would never be reached."""
    from treespec.constraints import GrammarVocabulary, TreeMatcher
    from treespec.drafters import PromptLookupDrafter

    tok = dec.tokenizer
    context = tok("x = 123\ny = 456\nx =")["input_ids"]
    lookup = PromptLookupDrafter(1)
    assert [tok.decode(t) for t in lookup.propose(context, 4).tree.tokens[1:]] == [" 1", "23", "\n", "y"]
    vocab = GrammarVocabulary.of(tok, dec.vocab_size, dec.eos_token_ids)
    for regex, kept in ((r" [0-9]+", [" 1", "23"]), (r"[a-z]+", []), (r"(.|\n)*", [" 1", "23", "\n", "y"])):
        lookup.constrain(TreeMatcher(vocab, Regex(regex)))
        assert [tok.decode(t) for t in lookup.propose(context, 4).tree.tokens[1:]] == kept, regex


def test_batch_has_a_matcher_per_request_and_equals_solo(dec):
    constraints = [JsonSchema(SCHEMAS[0]), None, Choice(("yes", "no")), JsonSchema(SCHEMAS[1])]
    greedy = SamplingConfig(temperature=0)
    outs = dec.generate_batch(["a = "] * 4, 48, sampling=greedy, constraint=constraints)
    for out, c in zip(outs, constraints):
        assert out.token_ids == dec.generate("a = ", 48, sampling=greedy, constraint=c).token_ids
    assert outs[2].text in ("yes", "no") and valid(outs[0].text, SCHEMAS[0])


def test_a_grammar_error_ends_that_request_only(dec, monkeypatch):
    from treespec.constraints import TreeMatcher

    bad = Choice(("never",))
    commit = TreeMatcher.commit

    def failing(self, tokens):
        if self.constraint == bad:
            raise ValueError("the grammar broke")
        commit(self, tokens)

    monkeypatch.setattr(TreeMatcher, "commit", failing)
    greedy = SamplingConfig(temperature=0)
    outs = dec.generate_batch(["a = ", "b = "], 24, sampling=greedy, constraint=[bad, Regex(REGEX)])
    assert outs[0].finish_reason == "error" and "grammar broke" in outs[0].error
    assert outs[1].finish_reason == "eos" and len(outs[1].text) == 8


def test_a_constraint_that_cannot_finish_ends_with_length(dec):
    out = dec.generate("s = ", 5, constraint=JsonSchema(SCHEMAS[1]))
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_a_bad_constraint_fails_before_any_work(dec):
    with pytest.raises(ValueError, match="constraint must be"):
        dec.generate("x", 4, constraint="[0-9]+")
    with pytest.raises(ValueError, match="request 1: .*invalid regex"):
        dec.generate_batch(["x", "y"], 4, constraint=[None, {"regex": "(("}])


def test_a_tokenizer_that_cannot_be_mapped_says_so():
    from treespec.constraints import GrammarVocabulary

    with pytest.raises(ValueError, match="cannot map this tokenizer"):
        GrammarVocabulary.of(object(), 10)


# ---- the CLI ----------------------------------------------------------------------------------
def test_cli_constraint_flags(capsys, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS[0]))
    assert (
        main(
            ["generate", "r = ", "--json-schema", str(schema), "--max-new-tokens", "80", "--temperature", "0"]
        )
        == 0
    )
    assert valid(capsys.readouterr().out.strip()[len("r = ") :], SCHEMAS[0])
    assert main(["generate", "answer: ", "--choice", "yes", "no", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip() in ("answer: yes", "answer: no")
    assert main(["generate", "x", "--regex", "[a-"]) == 2
    assert "invalid regex" in capsys.readouterr().err
    assert main(["generate", "x", "--grammar", str(tmp_path / "missing.lark")]) == 2


# ---- the server -------------------------------------------------------------------------------


def test_server_response_format_json_schema_streamed_or_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMAS[1], "strict": True}}
    for temperature in (0.0, 1.0):
        r = client.chat.completions.create(
            model="pycode", messages=[{"role": "user", "content": "a record"}], max_tokens=96,
            temperature=temperature, seed=1, response_format=fmt,
        )  # fmt: skip
        assert valid(r.choices[0].message.content, SCHEMAS[1]) or r.choices[0].finish_reason == "length"
    chunks = client.chat.completions.create(
        model="pycode", messages=[{"role": "user", "content": "a record"}], max_tokens=96, temperature=0,
        response_format=fmt, stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(
        model="pycode", messages=[{"role": "user", "content": "a record"}], max_tokens=96, temperature=0,
        response_format=fmt,
    )  # fmt: skip
    assert text == whole.choices[0].message.content


def test_server_json_object_structured_outputs_and_parse(client):
    r = client.chat.completions.create(
        model="pycode", messages=[{"role": "user", "content": "x"}], max_tokens=64, temperature=0,
        response_format={"type": "json_object"},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "length" or isinstance(
        json.loads(r.choices[0].message.content), dict
    )
    r = client.completions.create(
        model="pycode", prompt="phone: ", max_tokens=16, extra_body={"structured_outputs": {"regex": REGEX}}
    )
    assert len(r.choices[0].text) == 8
    r = client.completions.create(
        model="pycode",
        prompt="ok? ",
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.choices[0].text in ("yes", "no")
    pydantic = pytest.importorskip("pydantic")

    class Ticket(pydantic.BaseModel):
        status: Literal["open", "closed"]
        urgent: bool

    parsed = client.beta.chat.completions.parse(
        model="pycode", messages=[{"role": "user", "content": "a ticket"}], max_tokens=96, temperature=0,
        response_format=Ticket,
    )  # fmt: skip
    assert isinstance(parsed.choices[0].message.parsed, Ticket)


def test_server_tool_choice_answers_tool_calls(client):
    tool = {"type": "function", "function": {"name": "lookup", "parameters": SCHEMAS[0]}}
    r = client.chat.completions.create(
        model="pycode", messages=[{"role": "user", "content": "find Ada"}], max_tokens=96, temperature=0,
        tools=[tool], tool_choice={"type": "function", "function": {"name": "lookup"}},
    )  # fmt: skip
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "lookup" and r.choices[0].finish_reason == "tool_calls"
    assert valid(call.function.arguments, SCHEMAS[0])


@pytest.mark.parametrize(
    "extra,param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD}}},
         "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "g"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "structured_outputs"),
    ],
)  # fmt: skip
def test_server_bad_constraints_are_400s_in_openais_shape(server, extra, param):
    body = {"model": "pycode", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **extra}
    r = httpx.post(server["base"] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
