"""Command line of `treespec distill`: `add_arguments(parser)` and `run(args)`.

    treespec distill --target T --out DIR [--prompts FILE] [--minutes M] [--resume]
                     [--data-only | --data-from RUN ...] [recipe flags]

Every `Recipe` field is a flag (`--response-tokens 64`, `--no-train-on-prompt`, ...) whose help
is the field's comment; a flag not given keeps the recipe default (or, with --resume, the
value the run was started with).
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
from dataclasses import fields

from .recipe import Recipe

_FIELD_LINE = re.compile(r"^\s+(\w+): [^=]+= .*?#\s*(.*)$")


def _field_help() -> dict[str, str]:
    """Each Recipe field's comment, read from its source line."""
    return {
        m.group(1): m.group(2) for m in map(_FIELD_LINE.match, inspect.getsource(Recipe).splitlines()) if m
    }


def _type(annotation: str):
    for name, kind in (("bool", bool), ("int", int), ("float", float)):
        if annotation.split(" | ")[0] == name:
            return kind
    return str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target model: HF directory, .gguf file or hub id")
    parser.add_argument(
        "--out", required=True, help="output directory (the draft, distill.json, eval.jsonl/png)"
    )
    parser.add_argument(
        "--prompts",
        help=".txt (one per line), .jsonl or chat .json prompt file "
        "(default: a bundled set suited to the target)",
    )
    parser.add_argument("--minutes", type=float, help="wall-clock budget for data + training")
    parser.add_argument("--resume", action="store_true", help="continue the interrupted run in --out")
    parser.add_argument(
        "--data-only",
        action="store_true",
        help="only make data (all of --minutes), for a later run's --data-from",
    )
    parser.add_argument(
        "--data-from",
        nargs="+",
        metavar="DIR",
        help="train on the data of finished runs instead of making it (same target, prompts and data "
        "flags; several runs with distinct --seed: their samples together)",
    )
    head = parser.add_argument_group(
        "feature head (EAGLE-3), trained on --data-from's data",
        "with --head, the recipe flags below that a head has (--vocab-subset, --batch-size, --lr, "
        "--steps, --epochs, --evals, --eval-prompts, --eval-tokens, --seed, --target-dtype, ...) keep "
        "treespec.distill.head.HeadRecipe's defaults, not the draft's",
    )
    head.add_argument(
        "--head",
        action="store_true",
        help="train a feature head that drafts from the target's hidden states, instead of a draft model",
    )
    head.add_argument(
        "--unroll", type=int, help="training-time test: steps on the head's own states (default 2)"
    )
    head.add_argument(
        "--taps", type=int, nargs="+", help="target layers read (default: EAGLE-3's 2, N/2, N-3)"
    )
    head.add_argument(
        "--freeze-lm-head",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the target's output rows as the head's LM head (default: trained)",
    )
    head.add_argument(
        "--init-from",
        metavar="HEAD",
        help="start from this EAGLE-3 head directory (its taps and draft rows) instead of the target's "
        "last stage: a shipped or published head trained on",
    )
    helps = _field_help()
    group = parser.add_argument_group("recipe")
    for f in fields(Recipe):
        flag = "--" + f.name.replace("_", "-")
        kind = _type(str(f.type))
        help_text = f"{helps.get(f.name, '')} (default: {f.default})"
        if kind is bool:
            group.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            group.add_argument(flag, dest=f.name, type=kind, default=None, help=help_text)


def run(args: argparse.Namespace) -> None:
    from .pipeline import distill

    if args.head:
        run_head(args)
        return
    recipe = {f.name: getattr(args, f.name) for f in fields(Recipe) if getattr(args, f.name) is not None}
    out = distill(
        args.target,
        args.out,
        prompts=args.prompts,
        minutes=args.minutes,
        resume=args.resume,
        data_from=args.data_from,
        data_only=args.data_only,
        **recipe,
    )
    summary = json.loads((out / "distill.json").read_text())
    if args.data_only:
        data = summary["data"]
        print(
            f"wrote {out / 'work' / 'data'}: {data['train_prompts']} prompts, {data['response_positions']:,} "
            f"response positions in {data['seconds']:.0f} s; train on it with --data-from {out}"
        )
        return
    for d in summary["drafts"]:
        final = d["eval_final"]
        print(
            f"draft {d['dir']}: {d['params']:,} params, {d['steps']} steps; acceptance at depth 1: "
            f"T=0 {final['T0']['acceptance_by_depth'][0]}, T=1 {final['T1']['acceptance_by_depth'][0]}"
        )
    print(
        f"wrote {out} (distill.json, eval.jsonl, eval.png): {summary['budget_seconds']:.0f} s of data and "
        f"training, {summary['eval_seconds']:.0f} s of evaluation"
    )


def run_head(args: argparse.Namespace) -> None:
    from .head import HeadRecipe, distill_head

    if not args.data_from:
        raise ValueError(
            "--head trains on the data of finished runs: give --data-from DIR (made by --data-only)"
        )
    names = {f.name for f in fields(HeadRecipe)}
    given = {"target_dtype": "dtype"}  # the draft recipe's flag for the target's dtype
    recipe = {
        given.get(f.name, f.name): getattr(args, f.name)
        for f in fields(Recipe)
        if given.get(f.name, f.name) in names and getattr(args, f.name) is not None
    }
    head_flags = ("unroll", "taps", "freeze_lm_head", "init_from")
    recipe.update({k: getattr(args, k) for k in head_flags if getattr(args, k) is not None})
    out = distill_head(args.target, args.out, args.data_from, args.minutes, resume=args.resume, **recipe)
    summary = json.loads((out / "head.json").read_text())
    final = summary["curve"][-1]
    t0, t1 = final["T0"]["acceptance_by_depth"][0], final["T1"]["acceptance_by_depth"][0]
    print(
        f"wrote {out}: a feature head of {summary['params']:,} params, {summary['steps']} steps; "
        f"acceptance at depth 1: T=0 {t0}, T=1 {t1}"
    )
