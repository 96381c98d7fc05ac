"""The `treespec` command: generate text with tree speculation, or benchmark it.

    treespec generate "def quicksort(xs):" --width 2 --depth 4 --show-tree
    treespec bench --max-new-tokens 64 --repeats 3 --json bench.json

Both default to the bundled pair (treespec/zoo/pycode). Errors are one line on stderr and
exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import signal
import sys
import tempfile
from pathlib import Path

from .config import ADAPTIVE, STRATEGIES, SamplingConfig, TreeConfig
from .options import add_model_arguments, quantize_option

COLOURS = {"accepted": "\033[32m", "correction": "\033[33m", "bonus": "\033[36m"}  # green, yellow, cyan
RESET = "\033[0m"


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def _add_decode_args(p: argparse.ArgumentParser, max_new_tokens: int, width: int | None = None) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treespec", description="Lossless tree speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a continuation of a prompt")
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
    pen = gen.add_argument_group("penalties (applied identically to target and draft; see SamplingConfig)")
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
    _add_decode_args(gen, max_new_tokens=128)
    add_model_arguments(gen)

    chat = sub.add_parser("chat", help="talk to a chat model, turn by turn (an empty line or Ctrl-D ends)")
    chat.add_argument("--system", default=None, help="a system message to start the chat with")
    chat.add_argument("--plain", action="store_true", help="no speculation: plain autoregressive decoding")
    _add_decode_args(chat, max_new_tokens=256)
    add_model_arguments(chat)

    from .serve.cli import add_arguments as add_serve_arguments

    add_serve_arguments(sub.add_parser("serve", help="an OpenAI-compatible HTTP server (docs/serving.md)"))
    from .distill.cli import add_arguments as add_distill_arguments

    add_distill_arguments(sub.add_parser("distill", help="distil a draft for a target (docs/distill.md)"))

    bench = sub.add_parser(
        "bench",
        help="compare treespec with HF generate() on a prompt set",
        description="The 'tree' rows use --width/--depth/--strategy; the 'linear' rows a chain of "
        "the same depth.",
    )
    bench.add_argument(
        "--prompts",
        type=Path,
        help="JSON list of prompts (default: held-out prompts; chat instructions for a chat model)",
    )
    bench.add_argument("--n-prompts", type=int, default=8, help="use the first N prompts (default 8)")
    bench.add_argument("--repeats", type=int, default=3, help="interleaved repeats (default 3)")
    bench.add_argument(
        "--methods",
        default=",".join(_bench_methods()),
        help=f"comma-separated, of {','.join(_bench_methods(known=True))}",
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
        "experiments/build_llama_cpp.sh builds them",
    )
    _add_decode_args(bench, max_new_tokens=64, width=2)
    add_model_arguments(bench)
    return parser


def _bench_methods(known: bool = False):
    """The bench's default methods, or (`known`) every method it can run."""
    from .bench import KNOWN_METHODS, METHODS

    return KNOWN_METHODS if known else METHODS


def _configs(args) -> tuple[TreeConfig, SamplingConfig]:
    try:
        shape, strategy, depth = None, args.strategy, args.depth
        if args.shape is not None:
            from .sequoia import TreeShape

            shape = TreeShape.load(args.shape)
            strategy, depth = "sequoia", max(1, shape.depth)
        tree = TreeConfig(
            width=args.width,
            depth=depth,
            strategy=strategy,
            budget=args.budget,
            adaptive=args.adaptive,
            plain_fallback=args.plain_fallback,
            depth_max=args.depth_max,
            shape=shape,
        )
        sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as e:
        raise CliError(str(e).replace("TreeConfig.", "--")) from e
    return tree, sampling


def _paths(args) -> tuple:
    """(target, draft) from --pair / --target / --draft."""
    from .options import model_paths

    try:
        return model_paths(args, getattr(args, "plain", False))
    except ValueError as e:
        raise CliError(str(e)) from None


def _load(args):
    from .options import load_decoder

    _paths(args)  # flags that do not go together fail as a CLI error
    return load_decoder(args, getattr(args, "plain", False))


def use_colour(choice: str = "auto", stream=None) -> bool:
    """Colour codes only where a person reads them: a terminal, and NO_COLOR unset
    (https://no-color.org); "always"/"never" override both."""
    if choice != "auto":
        return choice == "always"
    stream = sys.stdout if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)()) and not os.environ.get("NO_COLOR")


def _check_writable(path: Path, flag: str) -> None:
    """Fail before a long run, not after it, if `path` cannot be written."""
    if path.is_dir():
        raise CliError(f"{flag} {path} is a directory; give a file name")
    parent = path.resolve().parent
    if not parent.is_dir():
        raise CliError(f"{flag} {path}: directory {parent} does not exist")
    try:
        if path.exists():
            with open(path, "a"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=parent, prefix=".treespec-write-test-"):
                pass
    except OSError as e:
        raise CliError(f"{flag} {path} is not writable ({e.strerror or e}); choose another path") from None


def _unescape(text: str) -> str:
    """Backslash escapes typed on a command line ("\\n", "\\t", "\\x41") as the characters."""
    try:
        return text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as e:
        raise CliError(f"--stop {text!r}: bad backslash escape ({e.reason})") from None


def cmd_generate(args) -> None:
    tree, sampling = _configs(args)
    from .verify import rule_name

    verification = rule_name(args.verification)  # a bad name fails before the models load
    try:
        sampling = dataclasses.replace(
            sampling,
            repetition_penalty=args.repetition_penalty,
            frequency_penalty=args.frequency_penalty,
            presence_penalty=args.presence_penalty,
        )
    except ValueError as e:
        raise CliError(re.sub(r"\b(repetition|frequency|presence)_penalty\b", r"--\1-penalty", str(e))) from e
    dec = _load(args)
    colour = args.show_tree and use_colour(args.color)
    if dec.tokenizer is None:
        raise CliError(f"no tokenizer found next to the target model {args.target!r}")
    from .output import TextStream

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
        stop=[_unescape(x) for x in args.stop] + args.stop_id or None,
        verification=verification,
        trace=args.trace,
    )
    sys.stdout.write(stream.finish(out.token_ids))  # what was held back
    sys.stdout.write("\n")
    if args.trace:
        from .trace import render_round

        for round_ in out.trace:
            print("\n" + render_round(round_, lambda t: dec.tokenizer.decode([t]), use_colour(args.color)))
    if args.show_tree:
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
        print(f"target weights: {weights}, computing in {str(dtype).removeprefix('torch.')}")
        if s.tree_nodes:
            print(
                f"acceptance rate {s.acceptance_rate:.2f} ({s.accepted_tokens} of {s.tree_nodes} "
                "drafted tokens), "
                f"mean accepted length {s.mean_accepted_length:.2f} per step"
            )
        if s.acceptance_by_depth:
            print(
                "acceptance by depth: "
                + " ".join(f"d{d + 1}={a:.2f}" for d, a in enumerate(s.acceptance_by_depth))
            )
        print(
            f"time: draft {s.draft_seconds:.2f}s, verify {s.verify_seconds:.2f}s, prefill "
            f"{s.prefill_seconds:.2f}s, "
            + (f"plan {s.plan_seconds:.2f}s, " if s.plan_seconds >= 0.005 else "")
            + f"other {s.other_seconds:.2f}s; draft forwards {s.draft_forwards}, tree nodes/step "
            f"{s.tree_nodes / max(1, s.target_steps):.1f}"
        )


def cmd_bench(args) -> None:
    from .backends.subset import VocabMap
    from .bench import native_runners, result_table, run_bench
    from .zoo import heldout_chats, load_prompts

    tree, sampling = _configs(args)
    prompts = None if args.prompts is None else load_prompts(args.prompts, args.n_prompts)  # before loading
    if args.repeats < 1 or args.n_prompts < 1 or args.batch_size < 1:
        raise CliError("--repeats, --n-prompts and --batch-size must be >= 1")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    known = _bench_methods(known=True)
    unknown = sorted(set(methods) - set(known))
    if unknown or not methods:
        raise CliError(f"--methods: unknown {unknown or 'empty list'}; choose from {','.join(known)}")
    _check_writable(args.json, "--json")
    args.drafter = args.drafter or "model"  # the bench runs HF models: a draft model, not a head
    paths = _paths(args)
    if paths[1] is None:
        raise CliError("bench compares against HF assisted generation: give --draft (or a --pair)")
    from .backends import hf
    from .bench import machine_info
    from .loading import checkpoint, resolve_device, resolve_dtype, resolve_weights

    draft_quantize = None if args.draft_quantize in ("auto", "none") else args.draft_quantize  # HF's draft
    if args.backend == "hf" and (args.quantize not in ("auto", "none") or draft_quantize):
        raise CliError("--quantize / --draft-quantize need the native backend; drop --backend hf")
    llama = _find_llama_cpp(args, paths[0])  # before loading: a wrong --llama-cpp fails at once
    paths = tuple(checkpoint(p) for p in paths)  # a GGUF file: its converted directory
    device = resolve_device(args.device)
    quantize = None if args.backend == "hf" else quantize_option(args.quantize)
    dtype, quantize = resolve_weights(args.dtype, quantize, paths[0], device, args.backend)
    draft_dtype = resolve_dtype(args.dtype if args.draft_dtype is None else args.draft_dtype, device, "draft")
    target, draft = hf.load_model(paths[0], dtype, device), hf.load_model(paths[1], draft_dtype, device)
    tokenizer = hf.load_tokenizer(paths[0])
    if prompts is None:  # the held-out prompts: chat instructions for a chat model
        chat = getattr(tokenizer, "chat_template", None)
        prompts = heldout_chats(args.n_prompts) if chat else load_prompts(None, args.n_prompts)
    backends = ("native", "hf") if args.backend == "auto" else (args.backend,)
    draft_vocab = VocabMap.load(paths[1]) if isinstance(paths[1], Path) else None
    runners = None
    if quantize or draft_quantize:  # treespec's rows run the quantized weights; HF's stay as loaded
        backends = ("native",)
        runners = native_runners(
            target, draft, args.compile, quantize, draft_quantize, draft_vocab, target_dir=paths[0]
        )
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"}
    # a progress line redrawn in place: terminal control codes, so only on a terminal
    progress = (
        (lambda msg: print(f"\r\033[K{msg}", end="", file=sys.stderr))
        if use_colour("auto", sys.stderr)
        else None
    )
    machine = machine_info(device)
    config.update(
        n_prompts=len(prompts),
        dtype=str(dtype).removeprefix("torch."),
        draft_dtype=str(draft_dtype).removeprefix("torch."),
        quantize=quantize,
        **machine,
    )
    print(
        f"{machine['device_name']} ({', '.join(machine['cpu_bf16_flags']) or 'no bf16 matrix flags'}), "
        f"{machine['threads']} threads; target {config['dtype']}, draft {config['draft_dtype']}",
        file=sys.stderr,
    )
    workdir = tempfile.TemporaryDirectory(prefix="treespec-bench-")
    llama_cpp = _llama_cpp_bench(llama, draft, tokenizer, draft_vocab, Path(workdir.name)) if llama else None
    result = run_bench(
        target,
        draft,
        tokenizer,
        prompts,
        args.max_new_tokens,
        tree,
        sampling,
        args.repeats,
        methods,
        backends,
        drafter=args.drafter,
        progress=progress,
        config=config,
        verifications=[v.strip() for v in args.verification.split(",") if v.strip()] or ["auto"],
        batch_size=args.batch_size,
        compile=args.compile,
        draft_vocab=draft_vocab,
        runners=runners,
        llama_cpp=llama_cpp,
        warmup=args.compile,  # compiled graphs compile outside the timed runs
    )
    workdir.cleanup()
    if progress is not None:
        print("\r\033[K", end="", file=sys.stderr)
    print(result_table(result))
    try:
        args.json.write_text(json.dumps(result.to_json(), indent=2))
    except OSError as e:  # the results are printed above: say why the file is missing
        why = e.strerror or e
        raise CliError(
            f"--json {args.json}: cannot write the results ({why}); the table above has them"
        ) from None
    print(f"wrote {args.json}")


def _find_llama_cpp(args, target):
    """(binaries, target GGUF) for the bench's llama.cpp rows, or None: --llama-cpp DIR must
    hold them and the target must be a GGUF file; found on PATH, they run where the target is one."""
    from .llamacpp import LlamaCpp
    from .loading import gguf

    try:
        llama = LlamaCpp.find(args.llama_cpp)
    except ValueError as e:
        raise CliError(f"--llama-cpp: {e}") from None
    if llama is None:
        return None
    try:
        return llama, gguf.gguf_file(target)
    except ValueError as e:
        if args.llama_cpp is not None:
            raise CliError(f"--llama-cpp runs the target's GGUF file, and {e}") from None
        print(f"llama.cpp found on PATH, not run: the target is not a GGUF file ({e})", file=sys.stderr)
        return None


def _llama_cpp_bench(found, draft, tokenizer, draft_vocab, workdir: Path):
    """llama.cpp's bench rows: plain decoding always, its speculative decoding where the draft
    (a subset draft through `draft_vocab`) converts to GGUF (a failed conversion says why and
    leaves the plain row)."""
    from .llamacpp import LlamaCppBench, draft_to_gguf

    llama, target_gguf = found
    bench = LlamaCppBench(llama, target_gguf)
    if llama.convert_script is None or llama.speculative_binary is None:
        print(
            "llama.cpp's speculative decoding not run: needs llama-speculative-simple and the source "
            "tree's convert_hf_to_gguf.py beside the binaries",
            file=sys.stderr,
        )
        return bench
    try:
        bench.draft_gguf = draft_to_gguf(draft, tokenizer, workdir, llama.convert_script, draft_vocab)
    except (RuntimeError, OSError) as e:
        print(
            f"llama.cpp's speculative decoding not run: the draft did not convert to GGUF ({e})",
            file=sys.stderr,
        )
    return bench


def cmd_chat(args) -> None:
    """A multi-turn chat on stdin/stdout: each turn re-renders the whole conversation with the
    chat template and streams the reply; the runners keep the cached turns the new prompt
    shares (`Runner.prefix_reuse`), so a turn prefills only what is new."""
    tree, sampling = _configs(args)
    dec = _load(args)
    if dec.tokenizer is None or not getattr(dec.tokenizer, "chat_template", None):
        raise CliError("this model has no chat template; use treespec generate")
    for runner in (dec.target_runner, dec.draft_runner):
        if runner is not None:
            runner.prefix_reuse = True
    from .output import TextStream

    messages = [{"role": "system", "content": args.system}] if args.system else []
    from . import parallel

    while True:
        try:  # tensor parallel: rank 0 reads the terminal, every rank decodes its line
            line = parallel.agree(input("> ") if parallel.leader() else None)
        except EOFError:
            line = parallel.agree("")  # the others learn of rank 0's end of input
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        stream = TextStream(dec.tokenizer)

        def show(new: list[int], sources: list[str], stream: TextStream = stream) -> None:
            sys.stdout.write(stream.feed(new))
            sys.stdout.flush()

        out = dec.generate(
            messages,
            args.max_new_tokens,
            tree=None if args.plain else tree,
            sampling=sampling,
            seed=args.seed,
            on_tokens=show,
        )
        sys.stdout.write(stream.finish(out.token_ids) + "\n")
        messages.append({"role": "assistant", "content": out.text})


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C, wherever it lands (imports included): no traceback
        return 130


class _Stderr(logging.Handler):
    """One line per record on whatever sys.stderr is when it is written."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"treespec: {record.getMessage()}", file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - logging's convention: a failed write is reported, not raised
            self.handleError(record)


def show_progress() -> None:
    """What takes more than a moment (a GGUF file's conversion, measuring this machine's costs,
    compiling a forward) as one line each on stderr, from treespec's loggers (once however often
    main() runs in a process)."""
    logger = logging.getLogger("treespec")
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        logger.addHandler(_Stderr())
    logger.setLevel(logging.INFO)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors exit 2 with argparse's one-line message
    from .parallel import launched_rank  # torch loads here

    rank = launched_rank()
    if rank:  # tensor parallel (torchrun): rank 0 prints and serves; the others only compute
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    from .backends.hf import quiet_transformers  # transformers loads here

    quiet_transformers()
    if args.command == "bench" and rank is not None:
        print(
            "treespec: error: bench runs in one process (it compares Hugging Face's rows); time a "
            "tensor-parallel target with experiments/tp_bench.py (docs/parallel.md)",
            file=sys.stderr,
        )
        return 2
    try:
        if args.command == "serve":  # the server reports its own errors and exit code
            from .serve.cli import run

            return run(args)
        if rank is not None:  # torchrun stops the others when one rank fails: say so
            signal.signal(signal.SIGTERM, _stopped_by_launcher)
        if not rank:
            show_progress()  # the server logs through its own --log-level
        return _run_command(args)
    finally:
        if rank is not None:
            from . import parallel

            parallel.shutdown()


def _stopped_by_launcher(signum, frame) -> None:
    from .parallel import launched_rank

    print(
        f"treespec: rank {launched_rank()}: stopped by the launcher (another rank failed, or the run "
        "was interrupted)",
        file=sys.stderr,
        flush=True,
    )
    os._exit(128 + signum)


def _run_command(args) -> int:
    from .parallel import ParallelError, launched_rank, lost

    rank = launched_rank()
    where = "" if rank is None else f"rank {rank}: "
    try:
        if args.command == "distill":
            from .distill.cli import run as cmd_distill

            cmd_distill(args)
        else:
            {"generate": cmd_generate, "chat": cmd_chat, "bench": cmd_bench}[args.command](args)
    except (CliError, ValueError) as e:
        print(f"treespec: {where}error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except ParallelError as e:
        print(f"treespec: error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # a collective that failed inside a forward: a rank died or hung
        if rank is None:
            raise
        print(f"treespec: error: {lost(e)}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # the reader went away (treespec generate --trace | head): stop quietly
        sys.stderr.close()  # nothing more can be said; keep Python's exit from complaining
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # stdout full or unwritable (> /dev/full): one line, not a traceback
        print(f"treespec: error: cannot write the output ({e.strerror or e})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
