"""The `treespec` command's flags: one `add_<command>_args` per subcommand, the speculation and
sampling flags they share (`add_decode_args`), and `build_parser`, which puts them together
(serve and distill add their own, from `treespec.serve.cli` and `treespec.distill.cli`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..bench.results import KNOWN_METHODS, METHODS
from ..config import ADAPTIVE, STRATEGIES
from ..options import add_model_arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treespec", description="Lossless tree speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_args(sub.add_parser("generate", help="generate a continuation of a prompt"))
    add_chat_args(
        sub.add_parser("chat", help="talk to a chat model, turn by turn (an empty line or Ctrl-D ends)")
    )
    from ..serve.cli import add_arguments as add_serve_arguments

    add_serve_arguments(sub.add_parser("serve", help="an OpenAI-compatible HTTP server (docs/serving.md)"))
    from ..distill.cli import add_arguments as add_distill_arguments

    add_distill_arguments(sub.add_parser("distill", help="distil a draft for a target (docs/distill.md)"))
    add_bench_args(
        sub.add_parser(
            "bench",
            help="compare treespec with HF generate() on a prompt set",
            description="The 'tree' rows use --width/--depth/--strategy; the 'linear' rows a chain of "
            "the same depth.",
        )
    )
    return parser


def add_decode_args(p: argparse.ArgumentParser, max_new_tokens: int, width: int | None = None) -> None:
    """The speculation and sampling flags of generate, chat and bench."""
    g = p.add_argument_group(
        "speculation and sampling",
        "with no --width, --depth, --strategy, --shape, --adaptive or --plain-fallback the tree is "
        "automatic: for each request the shape with the most expected tokens/s on this machine, or "
        "plain decoding",
    )
    g.add_argument(
        "--width", type=int, default=width, help="tree width; 1 = linear speculation (default: automatic)"
    )
    g.add_argument(
        "--depth", type=int, default=None, help="draft tokens per branch (default: automatic; 6 with --width)"
    )
    g.add_argument(
        "--strategy",
        default=None,
        choices=STRATEGIES,
        help="tree construction (default: auto; iid with --width)",
    )
    g.add_argument("--budget", type=int, default=None, help="strategy dynamic: draft nodes kept per round")
    g.add_argument(
        "--adaptive",
        default=None,
        choices=ADAPTIVE,
        help="adapt the depth between rounds (hf: +2 / -1 by full acceptance; entropy: by the draft's "
        "confidence)",
    )
    g.add_argument(
        "--plain-fallback",
        action="store_true",
        help="per request, plain rounds where they have measured more tokens/s than this tree",
    )
    g.add_argument("--depth-max", type=int, default=8, help="adaptive depth upper bound (default 8)")
    g.add_argument("--shape", type=Path, default=None, help="draft along a saved Sequoia TreeShape (JSON)")
    g.add_argument(
        "--verification",
        default="auto",
        help="auto (default: the best rule that applies), token, block (chains), traversal (trees drawn "
        "without replacement / deterministic); bench: a comma-separated list, one row per rule",
    )
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    g.add_argument("--seed", type=int, default=0)


def add_generate_args(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("prompt", help="text to continue (with --chat: the user's message)")
    gen.add_argument(
        "--chat", action="store_true", help="send the prompt as a user message through the chat template"
    )
    gen.add_argument("--plain", action="store_true", help="no speculation: plain autoregressive decoding")
    gen.add_argument("--ignore-eos", action="store_true", help="decode exactly --max-new-tokens tokens")
    gen.add_argument("--show-tree", action="store_true", help="colour tokens by origin and print statistics")
    gen.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop after the token that completes TEXT (repeatable; backslash escapes such as \\n work)",
    )
    gen.add_argument(
        "--stop-id",
        action="append",
        default=[],
        type=int,
        metavar="ID",
        help="stop after token id ID (repeatable)",
    )
    gen.add_argument(
        "--trace",
        action="store_true",
        help="after the text, print every round: the draft tree, each proposal's p, q, coin and outcome, "
        "the final token and where it came from",
    )
    gen.add_argument(
        "--color",
        default="auto",
        choices=("auto", "always", "never"),
        help="--show-tree / --trace colours: auto (default) = only on a terminal and without NO_COLOR set",
    )
    add_constraint_args(gen)
    add_penalty_args(gen)
    add_decode_args(gen, max_new_tokens=128)
    add_model_arguments(gen)


def add_constraint_args(p: argparse.ArgumentParser) -> None:
    """Structured output: at most one constraint (docs/structured.md)."""
    group = p.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    group.add_argument(
        "--json-schema", metavar="FILE", help="the output is JSON valid under the schema in FILE"
    )
    group.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    group.add_argument("--regex", metavar="PATTERN", help="the output matches PATTERN as a whole")
    group.add_argument(
        "--grammar",
        metavar="FILE",
        help="the output is a sentence of the grammar in FILE (Lark, or GBNF with ::=)",
    )
    group.add_argument(
        "--choice", nargs="+", metavar="TEXT", help="the output is exactly one of these strings"
    )


def add_penalty_args(p: argparse.ArgumentParser) -> None:
    pen = p.add_argument_group("penalties (applied identically to target and draft; see SamplingConfig)")
    pen.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="Hugging Face's: logits of tokens in prompt or output divided (> 0) or multiplied (< "
        "0) by it; 1 = off",
    )
    pen.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="OpenAI/vLLM: logit -= it x the token's count in the output; 0 = off",
    )
    pen.add_argument(
        "--presence-penalty",
        type=float,
        default=0.0,
        help="OpenAI/vLLM: logit -= it if the token occurs in the output; 0 = off",
    )


def add_chat_args(chat: argparse.ArgumentParser) -> None:
    chat.add_argument("--system", default=None, help="a system message to start the chat with")
    chat.add_argument("--plain", action="store_true", help="no speculation: plain autoregressive decoding")
    add_constraint_args(chat)
    add_decode_args(chat, max_new_tokens=256)
    add_model_arguments(chat)


def add_bench_args(bench: argparse.ArgumentParser) -> None:
    bench.add_argument(
        "--prompts",
        type=Path,
        help="JSON list of prompts (default: held-out prompts; chat instructions for a chat model)",
    )
    bench.add_argument("--n-prompts", type=int, default=8, help="use the first N prompts (default 8)")
    bench.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    bench.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated, of {','.join(KNOWN_METHODS)}",
    )
    bench.add_argument(
        "--json", type=Path, default=Path("treespec-bench.json"), help="where to write results"
    )
    bench.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help="requests per batch: HF generate() on a left-padded batch, treespec generate_batch() "
        "(hf-assisted cannot batch and is skipped); default 1",
    )
    bench.add_argument(
        "--llama-cpp",
        type=Path,
        metavar="DIR",
        help="also time llama.cpp on the target's GGUF file: its binaries in DIR (or DIR/bin, "
        "DIR/build/bin); without it, llama-completion on PATH is used if there is one. "
        "experiments/build/build_llama_cpp.sh builds them",
    )
    add_decode_args(bench, max_new_tokens=64, width=2)
    add_model_arguments(bench)
