"""What a token tree needs from a grammar engine, measured for xgrammar, llguidance and
outlines-core on this CPU with the default target's tokenizer (SmolLM2, 49,152 tokens):

- tokenizer: building the engine's view of the vocabulary (once per tokenizer)
- compile: a JSON schema, a regex and plain JSON (once per (constraint, tokenizer); cached)
- mask: the allowed-token mask after a node's path (once per tree node per round)
- step: advancing one token and going back (walking a tree depth first: accept, then roll back)
- fork: copying a matcher's state (walking a tree by copies instead)

Writes experiments/results/grammar_engines.json. Indicative (shared 2-core machine):
    nice -n 5 python experiments/costs/grammar_engines.py
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from importlib import metadata
from pathlib import Path

import torch

from treespec.loading.models import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "status": {"enum": ["active", "inactive", "banned"]},
        "score": {"type": "number"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "status", "address"],
}
DOC = (
    '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"], "status": "active", '
    '"address": {"city": "London", "zip": "12345"}}'
)
REGEX = r"[0-9]{3}-[0-9]{3}-[0-9]{4}( \(mobile\))?"
REGEX_DOC = "555-123-4567 (mobile)"


def timed(fn, repeat=1):
    out, times = None, []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return out, statistics.median(times)


def walk(tokens, mask_fn, step_fn, back_fn):
    """Masks along `tokens` (medians per node), then accept/rollback pairs."""
    masks, steps = [], []
    for t in tokens:
        _, s = timed(mask_fn)
        masks.append(s)
        t0 = time.perf_counter()
        step_fn(t)
        back_fn(1)
        step_fn(t)
        steps.append((time.perf_counter() - t0) / 2)
    return statistics.median(masks), statistics.median(steps)


def bench_xgrammar(hf, V, ids, rids):
    import xgrammar as xgr

    info, t_tok = timed(lambda: xgr.TokenizerInfo.from_huggingface(hf, vocab_size=V))
    res = {"version": metadata.version("xgrammar"), "tokenizer_s": t_tok}
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    js, res["compile_schema_s"] = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA)))
    rx, res["compile_regex_s"] = timed(lambda: compiler.compile_regex(REGEX))
    _, res["compile_json_s"] = timed(lambda: compiler.compile_builtin_json_grammar())
    bitmask = xgr.allocate_token_bitmask(1, V)
    for name, cg, toks in (("schema", js, ids), ("regex", rx, rids)):
        m = xgr.GrammarMatcher(cg)
        ok = True

        def step(t, m=m):
            nonlocal ok
            ok = m.accept_token(t) and ok

        res[f"mask_{name}_s"], res[f"step_{name}_s"] = walk(
            toks, lambda m=m: m.fill_next_token_bitmask(bitmask, 0), step, m.rollback
        )
        res[f"accepts_{name}_doc"] = ok
        _, res[f"fork_{name}_s"] = timed(m.fork, repeat=20)
    return res


def bench_llguidance(hf, V, ids, rids):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    tok, t_tok = timed(lambda: llguidance.hf.from_tokenizer(hf, n_vocab=V))
    res = {"version": metadata.version("llguidance"), "tokenizer_s": t_tok}
    gs = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    gr = llguidance.LLMatcher.grammar_from_regex(REGEX)
    gj = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
    # llguidance compiles lazily: a matcher's construction plus its first mask is the compile cost
    bitmask = llguidance.torch.allocate_token_bitmask(1, V)

    def first(g):
        m = llguidance.LLMatcher(tok, g)
        llguidance.torch.fill_next_token_bitmask(m, bitmask, 0)
        return m

    _, res["compile_schema_s"] = timed(lambda: first(gs))
    _, res["compile_regex_s"] = timed(lambda: first(gr))
    _, res["compile_json_s"] = timed(lambda: first(gj))
    for name, g, toks in (("schema", gs, ids), ("regex", gr, rids)):
        m = llguidance.LLMatcher(tok, g)
        res[f"mask_{name}_s"], res[f"step_{name}_s"] = walk(
            toks,
            lambda m=m: llguidance.torch.fill_next_token_bitmask(m, bitmask, 0),
            m.consume_token,
            m.rollback,
        )
        res[f"accepts_{name}_doc"] = not m.is_error()
        _, res[f"fork_{name}_s"] = timed(m.deep_copy, repeat=20)
    return res


def bench_outlines(hf, V, ids, rids):
    from outlines_core import Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    def vocab():
        eos = hf.eos_token_id
        table = {}
        for token, i in hf.get_vocab().items():
            if i != eos and i < V:
                table.setdefault(hf.convert_tokens_to_string([token]), []).append(i)
        return Vocabulary(eos, table)

    voc, t_tok = timed(vocab)
    res = {"version": metadata.version("outlines-core"), "tokenizer_s": t_tok}
    idx, res["compile_schema_s"] = timed(lambda: Index(build_regex_from_schema(json.dumps(SCHEMA)), voc))
    rx, res["compile_regex_s"] = timed(lambda: Index(REGEX, voc))
    res["compile_json_s"] = None  # regular expressions only: an arbitrary JSON object is not regular
    for name, index, toks in (("schema", idx, ids), ("regex", rx, rids)):
        state = [index.get_initial_state()]
        ok = True

        def mask(index=index, state=state):
            allowed = torch.tensor(index.get_allowed_tokens(state[-1]) or [], dtype=torch.long)
            return torch.zeros(V, dtype=torch.bool).index_fill_(0, allowed, True)

        def step(t, index=index, state=state):
            nonlocal ok
            nxt = index.get_next_state(state[-1], t)
            ok = ok and nxt is not None
            state.append(state[-1] if nxt is None else nxt)

        def back(n, state=state):
            del state[-n:]

        res[f"mask_{name}_s"], res[f"step_{name}_s"] = walk(toks, mask, step, back)
        res[f"accepts_{name}_doc"] = ok
        res[f"fork_{name}_s"] = 0.0  # states are integers: a fork is a copy of an int
    return res


def main() -> None:
    torch.set_num_threads(1)
    hf = load_tokenizer(ROOT / "treespec/zoo/smollm2/draft")
    V = 49152
    ids = hf(DOC, add_special_tokens=False)["input_ids"]
    rids = hf(REGEX_DOC, add_special_tokens=False)["input_ids"]
    out = {
        "machine": platform.processor() or platform.machine(),
        "vocab": V,
        "doc_tokens": len(ids),
        "engines": {},
    }
    for name, fn in (
        ("xgrammar", bench_xgrammar),
        ("llguidance", bench_llguidance),
        ("outlines-core", bench_outlines),
    ):
        try:
            out["engines"][name] = fn(hf, V, ids, rids)
        except Exception as e:  # noqa: BLE001 - one engine's failure is a result too
            out["engines"][name] = {"error": f"{type(e).__name__}: {e}"}
        print(name, json.dumps(out["engines"][name], indent=1))
    path = ROOT / "experiments/results/grammar_engines.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
