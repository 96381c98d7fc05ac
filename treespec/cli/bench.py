"""`treespec bench`: treespec against Hugging Face `generate()` (and llama.cpp where found) on
a prompt set, as a table and a JSON file (`treespec.bench.harness.run_bench` runs it)."""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..bench.results import KNOWN_METHODS
from .common import CliError, check_writable, configs, model_paths, use_colour


@dataclass
class LoadedModels:
    """The HF models the bench runs, and what loading them chose."""

    paths: tuple  # (target, draft) checkpoint directories
    target: object
    draft: object
    tokenizer: object
    device: object
    dtype: object
    draft_dtype: object
    quantize: str | None
    draft_quantize: str | None


def run(args) -> None:
    """Check the flags, load the models, time every method, print the table, write the JSON."""
    from ..loading import quantize_setting, resolve_quantize
    from ..zoo import load_prompts

    tree, sampling = configs(args)
    prompts = None if args.prompts is None else load_prompts(args.prompts, args.n_prompts)  # before loading
    methods = check_flags(args)
    paths = model_paths(args)
    if paths[1] is None:
        raise CliError("bench compares against HF assisted generation: give --draft (or a --pair)")
    draft_quantize = resolve_quantize(
        quantize_setting(args.draft_quantize), paths[1], None, None, "hf"
    )  # HF's draft
    if args.backend == "hf" and (args.quantize not in ("auto", "none") or draft_quantize):
        raise CliError("--quantize / --draft-quantize need the native backend; drop --backend hf")
    llama = find_llama_cpp(args, paths[0])  # before loading: a wrong --llama-cpp fails at once
    models = load_models(args, paths, draft_quantize)
    if prompts is None:  # the held-out prompts: chat instructions for a chat model
        prompts = default_prompts(models.tokenizer, args.n_prompts)
    backends, draft_vocab, runners = treespec_backends(args, models)
    config = bench_config(args, models, len(prompts))
    # a progress line redrawn in place: terminal control codes, so only on a terminal
    progress = (
        (lambda msg: print(f"\r\033[K{msg}", end="", file=sys.stderr))
        if use_colour("auto", sys.stderr)
        else None
    )
    from ..bench.harness import run_bench

    with tempfile.TemporaryDirectory(prefix="treespec-bench-") as workdir:
        llama_cpp = None
        if llama:
            llama_cpp = llama_cpp_bench(llama, models.draft, models.tokenizer, draft_vocab, Path(workdir))
        result = run_bench(
            models.target,
            models.draft,
            models.tokenizer,
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
            warmup=args.compile is True,  # compiled graphs compile outside the timed runs
        )
    if progress is not None:
        print("\r\033[K", end="", file=sys.stderr)
    write_results(result, args.json)


def check_flags(args) -> list[str]:
    """The methods to run; a CliError for counts below 1, unknown methods or a --json that
    cannot be written (before anything loads). A bench without --drafter runs a draft model."""
    if args.repeats < 1 or args.n_prompts < 1 or args.batch_size < 1:
        raise CliError("--repeats, --n-prompts and --batch-size must be >= 1")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(KNOWN_METHODS))
    if unknown or not methods:
        raise CliError(f"--methods: unknown {unknown or 'empty list'}; choose from {','.join(KNOWN_METHODS)}")
    check_writable(args.json, "--json")
    args.drafter = args.drafter or "model"  # the bench runs HF models: a draft model, not a head
    return methods


def load_models(args, paths: tuple, draft_quantize: str | None) -> LoadedModels:
    """The target and draft as HF models in the dtypes the flags resolve to (a GGUF file: its
    converted directory), and the target's tokenizer."""
    from ..backends import hf
    from ..loading import checkpoint, quantize_setting, resolve_device, resolve_dtype, resolve_weights

    paths = tuple(checkpoint(p) for p in paths)
    device = resolve_device(args.device)
    dtype, quantize = resolve_weights(
        args.dtype, quantize_setting(args.quantize), paths[0], device, args.backend
    )
    draft_dtype = resolve_dtype(args.dtype if args.draft_dtype is None else args.draft_dtype, device, "draft")
    return LoadedModels(
        paths=paths,
        target=hf.load_model(paths[0], dtype, device),
        draft=hf.load_model(paths[1], draft_dtype, device),
        tokenizer=hf.load_tokenizer(paths[0]),
        device=device,
        dtype=dtype,
        draft_dtype=draft_dtype,
        quantize=quantize,
        draft_quantize=draft_quantize,
    )


def default_prompts(tokenizer, n: int) -> list:
    """The first `n` held-out prompts: chat instructions for a model with a chat template."""
    from ..zoo import heldout_chats, load_prompts

    return heldout_chats(n) if getattr(tokenizer, "chat_template", None) else load_prompts(None, n)


def treespec_backends(args, models: LoadedModels) -> tuple[tuple[str, ...], object, dict | None]:
    """(backends, the draft's VocabMap or None, runners or None): with quantized weights
    treespec's rows run native runners of them (HF's rows stay as loaded); otherwise
    `run_bench` makes one pair of runners per backend."""
    from ..backends.subset import VocabMap

    backends = ("native", "hf") if args.backend == "auto" else (args.backend,)
    draft_path = models.paths[1]
    draft_vocab = VocabMap.load(draft_path) if isinstance(draft_path, Path) else None
    if not (models.quantize or models.draft_quantize):
        return backends, draft_vocab, None
    from ..bench.harness import native_runners

    runners = native_runners(
        models.target,
        models.draft,
        args.compile,
        models.quantize,
        models.draft_quantize,
        draft_vocab,
        target_dir=models.paths[0],
    )
    return ("native",), draft_vocab, runners


def bench_config(args, models: LoadedModels, n_prompts: int) -> dict:
    """What the JSON records as the run's config: the flags, what loading chose and the
    machine (also printed as one line on stderr)."""
    from ..bench.measure import machine_info

    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    machine = machine_info(models.device)
    config.update(
        n_prompts=n_prompts,
        dtype=str(models.dtype).removeprefix("torch."),
        draft_dtype=str(models.draft_dtype).removeprefix("torch."),
        quantize=models.quantize,
        **machine,
    )
    print(
        f"{machine['device_name']} ({', '.join(machine['cpu_bf16_flags']) or 'no bf16 matrix flags'}), "
        f"{machine['threads']} threads; target {config['dtype']}, draft {config['draft_dtype']}",
        file=sys.stderr,
    )
    return config


def write_results(result, path: Path) -> None:
    """The table on stdout, the results as JSON in `path`."""
    from ..bench.results import result_table

    print(result_table(result))
    try:
        path.write_text(json.dumps(result.to_json(), indent=2))
    except OSError as e:  # the results are printed above: say why the file is missing
        why = e.strerror or e
        raise CliError(f"--json {path}: cannot write the results ({why}); the table above has them") from None
    print(f"wrote {path}")


def find_llama_cpp(args, target):
    """(binaries, target GGUF) for the bench's llama.cpp rows, or None: --llama-cpp DIR must
    hold them and the target must be a GGUF file; found on PATH, they run where the target is one."""
    from ..bench.llamacpp import LlamaCpp
    from ..loading import gguf

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


def llama_cpp_bench(found, draft, tokenizer, draft_vocab, workdir: Path):
    """llama.cpp's bench rows: plain decoding always, its speculative decoding where the draft
    (a subset draft through `draft_vocab`) converts to GGUF (a failed conversion says why and
    leaves the plain row)."""
    from ..bench.llamacpp import LlamaCppBench, draft_to_gguf

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
