"""Structured outputs: which drafting a constrained request should take where the automatic tree
drafts nothing with its own drafter (the default pair on a CPU), in one process, interleaved.

Modes, every one under the JSON schema: plain decoding; forced tokens alone (a drafter that
proposes nothing: the tree is its root and the tokens the grammar forces); prompt lookup chains
of 2, 3, 4 and 8 tokens (cut by the grammar, forced tokens below); a chain of 4 that needs a match
of 2 tokens or more; and the default (`TreeConfig()`). Tasks: the six extraction prompts of
speed.py and two JSON story prompts, which copy little. Reports median tokens/s over prompts and
repeats (the whole call, and decoding alone) and tokens/step, per task set and temperature.

    nice -n 5 python experiments/structured/lookup_variants.py [--repeats 2] [--temperatures 0 1]
        [--modes "forced only" "lookup, chain of 4"]

Writes experiments/results/structured_lookup_variants.json. Numbers are indicative on a shared
machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import speed

from treespec import SamplingConfig, SpeculativeDecoder, TreeConfig
from treespec.constraints import JsonSchema
from treespec.drafters import Drafter, DrafterFactory, PromptLookupDrafter
from treespec.proposal import DraftTree
from treespec.rng import Rng

ROOT = Path(__file__).resolve().parents[2]
STORY = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "story": {"type": "string", "maxLength": 300},
    },
    "required": ["title", "story"],
    "additionalProperties": False,
}
STORIES = ["a cat who learns to swim", "a robot in a garden"]


class NoDraft(Drafter):
    """Proposes nothing: a round scores its root and the tokens the grammar forces below it."""

    def start(self, prompt: Sequence[int], sampling: SamplingConfig, rng: Rng) -> None:
        pass

    def propose(self, context: Sequence[int], depth: int) -> DraftTree:
        return DraftTree.root_only(context[-1])


def modes(own: DrafterFactory) -> dict:
    """name -> (drafter factory, tree)."""
    out = {"plain": (own, None), "forced only": (DrafterFactory(NoDraft()), TreeConfig(width=1, depth=1))}
    for d in (2, 3, 4, 8):
        out[f"lookup, chain of {d}"] = (DrafterFactory("lookup"), TreeConfig(width=1, depth=d))
    out["lookup, chain of 4, 2-token matches"] = (
        DrafterFactory(PromptLookupDrafter(1, max_ngram=3, min_ngram=2)), TreeConfig(width=1, depth=4)
    )  # fmt: skip
    out["default (TreeConfig())"] = (own, TreeConfig())
    return out


def tasks(kind: str) -> list[tuple[dict, list[dict]]]:
    if kind == "extraction":
        return [(schema, speed.chat(schema, text)) for schema, text in speed.TASKS]
    ask = "Write a very short story about {}. Answer as JSON with the fields title and story."
    return [(STORY, [{"role": "user", "content": ask.format(s)}]) for s in STORIES]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--out", default=str(ROOT / "experiments/results/structured_lookup_variants.json"))
    ap.add_argument("--modes", nargs="+", default=None, help="only these (names' prefixes), and plain")
    args = ap.parse_args()
    dec = SpeculativeDecoder.from_pretrained()
    forward = "compiled" if getattr(dec.target_runner, "compiled", None) is not None else "eager"
    print("target forward:", forward, flush=True)
    own = dec.drafter
    table = modes(own)
    if args.modes:
        table = {m: v for m, v in table.items() if m == "plain" or any(m.startswith(p) for p in args.modes)}
    schema, messages = tasks("extraction")[0]
    dec.generate(messages, 8, constraint=JsonSchema(schema))  # warm up (and plan the tree)
    summary = {}
    for T in args.temperatures:
        sampling = SamplingConfig(temperature=T)
        for kind in ("extraction", "stories"):
            runs = {m: [] for m in table}
            for rep in range(args.repeats):
                for schema, messages in tasks(kind):
                    for m, (factory, tree) in table.items():
                        dec.drafter = factory
                        t = time.perf_counter()
                        out = dec.generate(
                            messages, args.max_new_tokens, tree=tree, sampling=sampling, seed=rep,
                            constraint=JsonSchema(schema),
                        )  # fmt: skip
                        seconds = time.perf_counter() - t
                        s = out.stats
                        runs[m].append((len(out.token_ids) / seconds, s.tokens_per_second, s.tokens_per_step))
            dec.drafter = own
            plain = statistics.median(r[0] for r in runs["plain"])
            rows = {}
            for m, rs in runs.items():
                tok_s = statistics.median(r[0] for r in rs)
                rows[m] = {
                    "tok_s": tok_s,
                    "over_plain": tok_s / plain,
                    "decode_tok_s": statistics.median(r[1] for r in rs),
                    "tokens_per_step": statistics.mean(r[2] for r in rs),
                }
                print(
                    f"T={T} {kind:10s} {m:38s} {tok_s:6.1f} tok/s ({tok_s / plain:.2f}x) "
                    f"decode {rows[m]['decode_tok_s']:6.1f} tokens/step {rows[m]['tokens_per_step']:.2f}",
                    flush=True,
                )
            summary[f"T{T} {kind}"] = rows
    Path(args.out).write_text(json.dumps({"forward": forward, "summary": summary}, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
