"""`treespec generate`: one prompt's continuation, streamed as it is decoded; with --show-tree
coloured by where each token came from and followed by the run's statistics, with --trace
followed by every round."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

from .common import CliError, configs, load, use_colour

COLOURS = {"accepted": "\033[32m", "correction": "\033[33m", "bonus": "\033[36m"}  # green, yellow, cyan
RESET = "\033[0m"


def unescape(text: str) -> str:
    """Backslash escapes typed on a command line ("\\n", "\\t", "\\x41") as the characters."""
    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as e:
        raise CliError(f"--stop {text!r}: bad backslash escape ({e.reason})") from None


def constraint_of(args):
    """The constraint the flags ask for (None: none), checked before any model loads."""
    from ..constraints import Choice, Grammar, JsonObject, JsonSchema, Regex

    def read(flag: str, path: str) -> str:
        try:
            return Path(path).read_text()
        except OSError as e:
            raise CliError(f"{flag} {path}: {e.strerror or e}") from None

    try:
        if args.json_schema is not None:
            return JsonSchema(read("--json-schema", args.json_schema), name=Path(args.json_schema).stem)
        if args.json_object:
            return JsonObject()
        if args.regex is not None:
            return Regex(args.regex)
        if args.grammar is not None:
            text = read("--grammar", args.grammar)
            return Grammar(text, "gbnf" if "::=" in text else "lark")
        if args.choice is not None:
            return Choice(tuple(args.choice))
    except ValueError as e:
        raise CliError(str(e)) from None
    return None


def run(args) -> None:
    """Stream the continuation of the prompt (a user message with --chat) to stdout."""
    tree, sampling = configs(args)
    from ..rules import rule_name

    verification = rule_name(args.verification)  # a bad name fails before the models load
    constraint = constraint_of(args)  # so does a bad schema, regex or grammar
    try:
        sampling = dataclasses.replace(
            sampling,
            repetition_penalty=args.repetition_penalty,
            frequency_penalty=args.frequency_penalty,
            presence_penalty=args.presence_penalty,
        )
    except ValueError as e:
        raise CliError(re.sub(r"\b(repetition|frequency|presence)_penalty\b", r"--\1-penalty", str(e))) from e
    dec = load(args)
    colour = args.show_tree and use_colour(args.color)
    if dec.tokenizer is None:
        raise CliError(f"no tokenizer found next to the target model {args.target!r}")
    from ..output import TextStream

    stream = TextStream(dec.tokenizer)

    def on_tokens(new: list[int], sources: list[str]) -> None:
        for t, src in zip(new, sources):
            piece = stream.feed([t])
            sys.stdout.write(f"{COLOURS[src]}{piece}{RESET}" if colour and piece else piece)
        sys.stdout.flush()

    if args.chat:
        prompt = [{"role": "user", "content": args.prompt}]
    else:
        sys.stdout.write(args.prompt)
        prompt = args.prompt
    out = dec.generate(
        prompt,
        args.max_new_tokens,
        tree=None if args.plain else tree,
        sampling=sampling,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        on_tokens=on_tokens,
        stop=[unescape(x) for x in args.stop] + args.stop_id or None,
        verification=verification,
        trace=args.trace,
        constraint=constraint,
    )
    sys.stdout.write(stream.finish(out.token_ids))  # what was held back
    sys.stdout.write("\n")
    if args.trace:
        from ..trace import render_round

        for round_ in out.trace:
            print("\n" + render_round(round_, lambda t: dec.tokenizer.decode([t]), use_colour(args.color)))
    if args.show_tree:
        print_statistics(dec, out, colour)


def print_statistics(dec, out, colour: bool) -> None:
    """--show-tree's report after the text: the colours' legend, where the tokens came from,
    the tree, the target's weights, acceptance and where the time went."""
    s = out.stats
    if colour:
        legend = " ".join(f"{COLOURS[k]}{k}{RESET}" for k in COLOURS)
        print(f"\n[{legend}]")
    else:
        print()
    print(
        "token sources: "
        + ", ".join(f"{k} {out.sources.count(k)}" for k in COLOURS)
        + f"; verification: {out.verification}"
    )
    print(
        f"tokens {s.tokens} in {s.target_steps} target steps: {s.tokens_per_step:.2f} tokens/step, "
        f"{s.tokens_per_second:.1f} tokens/s ({out.finish_reason})"
    )
    if out.plan is not None:
        print(f"tree: {out.plan}")
    target = dec.target_runner  # what dtype="auto" / quantize="auto" chose, or what was asked
    weights, dtype = getattr(target, "quantize", None) or "dense", getattr(target, "dtype", "?")
    print(f"target weights: {weights}, computing in {str(dtype).removeprefix('torch.')}, {forward(target)}")
    if s.tree_nodes:
        print(
            f"acceptance rate {s.acceptance_rate:.2f} ({s.accepted_tokens} of {s.tree_nodes} "
            "drafted tokens), "
            f"mean accepted length {s.mean_accepted_length:.2f} per step"
        )
    if s.acceptance_by_depth:
        by_depth = " ".join(f"d{d + 1}={a:.2f}" for d, a in enumerate(s.acceptance_by_depth))
        print(f"acceptance by depth: {by_depth}")
    print(
        f"time: draft {s.draft_seconds:.2f}s, verify {s.verify_seconds:.2f}s, prefill "
        f"{s.prefill_seconds:.2f}s, "
        + (f"plan {s.plan_seconds:.2f}s, " if s.plan_seconds >= 0.005 else "")
        + f"other {s.other_seconds:.2f}s; draft forwards {s.draft_forwards}, tree nodes/step "
        f"{s.tree_nodes / max(1, s.target_steps):.1f}"
    )


def forward(target) -> str:
    """How the target's forwards run, and how a kept compiled forward could run them."""
    if getattr(target, "compiled", None) is not None:
        return "compiled forward"
    if getattr(target, "compile_setting", False) == "auto":
        return (
            "eager forward (--compile once builds its graphs for this machine, minutes; later runs load them)"
        )
    return "eager forward"
