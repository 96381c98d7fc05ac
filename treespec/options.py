"""What every front end loads, written once: the model flags (`add_model_arguments`), which
paths they name (`model_paths`: --pair, --target, --draft or the default pair) and the one call
to `SpeculativeDecoder.from_pretrained` (`load_decoder`). `treespec generate/chat/bench` and
`treespec serve` take the same flags with the same meaning."""

from __future__ import annotations

import argparse

from .config import DRAFTER_KINDS, QUANTIZATIONS

BACKENDS = ("auto", "native", "hf")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    from .zoo import PAIRS, default_pair_name

    default = default_pair_name()
    g = p.add_argument_group(f"models (default: the {default} pair)")
    g.add_argument(
        "--pair", choices=PAIRS, default=None, help=f"a named pair (default {default}; TREESPEC_PAIR sets it)"
    )
    g.add_argument("--target", help="target model: HF id, local directory or GGUF file")
    g.add_argument(
        "--draft",
        help="draft model: HF id, local directory or GGUF file, or an EAGLE-3 head directory "
        "(not needed for --drafter ngram/lookup)",
    )
    g.add_argument(
        "--drafter",
        default=None,
        choices=DRAFTER_KINDS,
        help="who proposes: the draft model, a feature head (EAGLE-3; the default when --draft is one, "
        "and a named pair's own head where it ships one), n-gram tables, prompt lookup, or model+n-gram "
        "merged (default: the pair's, else model)",
    )
    g.add_argument(
        "--dtype",
        default="auto",
        help="auto (default: bf16 on CUDA; on CPU a bf16 target where bf16 products measure faster, "
        "an fp32 draft, a head in the target's dtype), float32, bfloat16",
    )
    g.add_argument("--draft-dtype", default=None, help="the draft's dtype (default: as --dtype)")
    g.add_argument("--device", default=None, help="torch device (default: cpu)")
    g.add_argument(
        "--backend",
        default="auto",
        choices=BACKENDS,
        help="auto (default): treespec's native forward where supported, else HF; bench: both",
    )
    forward = g.add_mutually_exclusive_group()
    forward.add_argument(
        "--compile",
        action="store_const",
        const=True,
        default="auto",
        help="run the native forwards as inductor graphs, compiled once for this machine and model "
        "(minutes) and kept: later runs load them by default. Without it, the graphs already kept "
        "run where quantized weights have them, else the eager forward; bench decodes every prompt "
        "once, untimed, first (docs/performance.md)",
    )
    forward.add_argument(
        "--eager",
        dest="compile",
        action="store_const",
        const=False,
        help="the eager forward, even where compiled graphs are kept",
    )
    g.add_argument(
        "--quantize",
        choices=("auto", "none", *QUANTIZATIONS),
        default="auto",
        help="the target's weight format (native backend): auto (default) runs a GGUF file's own "
        "4-bit blocks where this CPU multiplies int4 faster, else the weights in --dtype; int8 / "
        "int4 quantize any target (the quantized model's own output; docs/performance.md); q4q8 "
        "(CPU): the same 4-bit weights times int8-rounded activations, another model again",
    )
    g.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="N",
        help="tensor parallelism: the target split over N processes; launch them with "
        "`torchrun --nproc-per-node N -m treespec ...` (default: every process torchrun launched; "
        "docs/parallel.md)",
    )
    g.add_argument(
        "--draft-quantize",
        choices=("auto", "none", *QUANTIZATIONS),
        default="auto",
        help="the draft's weights as int8, int4 or q4q8 (native backend; lossless: any draft is); auto "
        "(default): a feature head's as int4 where int4 products measure faster here",
    )


def model_paths(args, model_free: bool = False) -> tuple:
    """(target, draft) that `args` name: a pair's (its head where it ships one, unless
    --drafter says otherwise), --target/--draft, or the default pair's. `model_free`: nothing
    will be drafted by a model (plain decoding), so --target alone is enough. ValueError for
    flags that do not go together."""
    from .zoo import pair, pair_draft

    if args.pair is not None and (args.target or args.draft):
        raise ValueError("give --pair or --target/--draft, not both")
    if args.target is None:
        if args.draft is not None:
            raise ValueError("--draft needs --target")
        return pair(args.pair)[0], pair_draft(args.pair, args.drafter)
    if args.draft is None and not (model_free or args.drafter in ("ngram", "lookup")):
        raise ValueError("--target needs --draft (or --drafter ngram / lookup, or --plain)")
    return args.target, args.draft


def load_decoder(args, model_free: bool = False, **overrides):
    """`SpeculativeDecoder.from_pretrained` with what `args` say (`overrides` replace them)."""
    from .decoder import SpeculativeDecoder
    from .loading import quantize_setting

    target, draft = model_paths(args, model_free)
    kwargs = dict(
        target=target,
        draft=draft,
        dtype=args.dtype,
        device=args.device,
        backend=args.backend,
        draft_dtype=args.draft_dtype,
        drafter=args.drafter or "model",
        compile=args.compile,
        quantize=quantize_setting(args.quantize),
        draft_quantize=quantize_setting(args.draft_quantize),
        tp=args.tp,
    )
    return SpeculativeDecoder.from_pretrained(**{**kwargs, **overrides})
