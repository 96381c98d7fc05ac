"""Structured outputs: speed of constrained decoding on JSON-schema extraction prompts, with
the default pair, in one process, interleaved (prompt by prompt, every mode in turn).

Modes: plain decoding unconstrained, plain decoding under the schema, and the default
(speculative, automatic tree, forced tokens drafted) under the schema. Reports tokens/s
(median over prompts and repeats; the whole call, and decoding alone: the prompt's prefill,
which no mode changes, left out), tokens/step, the share of emitted tokens the grammar forced
and how many accepted draft tokens were forced, and whether every output validates.

    nice -n 5 python experiments/structured/speed.py --repeats 2 --max-new-tokens 96 [--eager]

Writes experiments/results/structured_speed.json. Numbers are indicative on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jsonschema

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.constraints import JsonSchema

ROOT = Path(__file__).resolve().parents[2]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "job": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "format": "email"},
    },
    "required": ["name", "age", "job", "city"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 40},
        "items": {
            "type": "array",
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "product": {"type": "string", "maxLength": 30},
                    "quantity": {"type": "integer", "minimum": 1},
                    "price": {"type": "number"},
                },
                "required": ["product", "quantity", "price"],
                "additionalProperties": False,
            },
        },
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "express": {"type": "boolean"},
    },
    "required": ["customer", "items", "status", "express"],
    "additionalProperties": False,
}
EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 50},
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "attendees": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 5},
        "location": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "room": {"type": "string", "maxLength": 20},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
        "priority": {"enum": ["low", "medium", "high"]},
    },
    "required": ["title", "date", "attendees", "location", "priority"],
    "additionalProperties": False,
}
TASKS = [
    (PERSON, "Maria Lopez is a 29-year-old nurse who lives in Madrid. Her email is maria.lopez@example.es."),
    (PERSON, "John Smith, 45, works as a carpenter in Boston."),
    (ORDER, "Alice ordered two notebooks at 3.50 each and one pen at 1.20. It shipped yesterday by express."),
    (ORDER, "Order for Bob: 3 coffee mugs (8 dollars each). Not shipped yet, standard delivery."),
    (EVENT, "Team planning meeting on 2024-05-14 in Berlin, room 4B, with Anna, Tom and Lee. High priority."),
    (EVENT, "Book club on 2024-09-02 in Paris with Claire and Marc; low priority."),
]


def chat(schema: dict, text: str) -> list[dict]:
    ask = f"Extract the information as JSON with the fields {', '.join(schema['properties'])}.\n\n{text}"
    return [{"role": "user", "content": ask}]


def run_mode(dec, mode: str, schema, text, n, sampling, seed) -> dict:
    constraint = None if mode == "plain-unconstrained" else JsonSchema(schema)
    tree = TreeConfig() if mode == "speculative" else None
    t = time.perf_counter()
    out = dec.generate(chat(schema, text), n, tree=tree, sampling=sampling, seed=seed, constraint=constraint)
    dt = time.perf_counter() - t
    valid = None
    if constraint is not None:
        try:
            jsonschema.validate(json.loads(out.text), schema)
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = out.finish_reason == "length"  # cut short by max_new_tokens: not a failure to parse
    s = out.stats
    return {
        "tokens": len(out.token_ids), "seconds": dt, "tok_s": len(out.token_ids) / dt,
        "decode_tok_s": s.tokens_per_second,
        "tokens_per_step": s.tokens_per_step, "forced": s.forced_tokens, "forced_accepted": s.forced_accepted,
        "accepted": s.accepted_tokens, "finish": out.finish_reason, "valid": valid, "text": out.text,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--out", default=None, help="default: results/structured_speed[_eager].json")
    ap.add_argument(
        "--eager", action="store_true", help="the eager forward even where compiled graphs are kept"
    )
    args = ap.parse_args()
    name = "structured_speed_eager.json" if args.eager else "structured_speed.json"
    args.out = args.out or str(ROOT / "experiments/results" / name)
    dec = SpeculativeDecoder.from_pretrained(compile=False if args.eager else "auto")
    forward = "compiled" if getattr(dec.target_runner, "compiled", None) is not None else "eager"
    print("target forward:", forward, flush=True)
    modes = ["plain-unconstrained", "plain-constrained", "speculative"]
    dec.generate(chat(*TASKS[0]), 8, constraint=JsonSchema(TASKS[0][0]))  # warm up (and plan the tree)
    runs = []
    for T in args.temperatures:
        sampling = SamplingConfig(temperature=T)
        for rep in range(args.repeats):
            for i, (schema, text) in enumerate(TASKS):
                for mode in modes:
                    r = run_mode(dec, mode, schema, text, args.max_new_tokens, sampling, seed=rep)
                    runs.append({"T": T, "repeat": rep, "task": i, "mode": mode, **r})
                    tau, forced = r["tokens_per_step"], f"{r['forced']}/{r['tokens']}"
                    print(
                        f"T={T} rep={rep} task={i} {mode:20s} {r['tok_s']:6.1f} tok/s tau={tau:.2f} "
                        f"forced={forced} accepted forced={r['forced_accepted']} valid={r['valid']}",
                        flush=True,
                    )
    summary = {}
    for T in args.temperatures:
        rows = {m: [r for r in runs if r["T"] == T and r["mode"] == m] for m in modes}
        med = {m: statistics.median(r["tok_s"] for r in rs) for m, rs in rows.items()}
        decode = {m: statistics.median(r["decode_tok_s"] for r in rs) for m, rs in rows.items()}
        spec = rows["speculative"]
        summary[f"T{T}"] = {
            "tok_s": med,
            "tokens_per_step": {m: statistics.mean(r["tokens_per_step"] for r in v) for m, v in rows.items()},
            "constrained_over_unconstrained_plain": med["plain-constrained"] / med["plain-unconstrained"],
            "speculative_over_constrained_plain": med["speculative"] / med["plain-constrained"],
            "decode_tok_s": decode,  # the prompt's prefill left out
            "decode_speculative_over_constrained_plain": decode["speculative"] / decode["plain-constrained"],
            "forced_share": sum(r["forced"] for r in spec) / sum(r["tokens"] for r in spec),
            "forced_accepted": sum(r["forced_accepted"] for r in spec),
            "accepted": sum(r["accepted"] for r in spec),
            "all_valid": all(r["valid"] for m in modes[1:] for r in rows[m]),
        }  # fmt: skip
        print(json.dumps(summary[f"T{T}"], indent=1))
    Path(args.out).write_text(
        json.dumps({"forward": forward, "summary": summary, "runs": runs}, indent=1) + "\n"
    )
    print("wrote", args.out)


if __name__ == "__main__":
    main()
