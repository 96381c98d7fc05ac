"""Speed comparison in one process: treespec against Hugging Face `generate()`.

Methods (all on the same target/draft, same prompts, same max_new_tokens):

    hf              target.generate()                         plain HF decoding
    hf-assisted     target.generate(assistant_model=draft)    HF's linear speculative decoding
    llama.cpp       llama-completion on the target's GGUF     with `llama_cpp` (`treespec.llamacpp`)
    llama.cpp-spec  llama-speculative-simple, the draft's GGUF  ... and a draft GGUF
    autoregressive  treespec, tree=None                       the in-library baseline
    linear          treespec, TreeConfig(width=1, depth)
    tree            treespec, TreeConfig(width, depth, strategy)
    goodput         treespec, the linear chain with plain_fallback=True: per request, speculate
                    or decode plainly by which measured more tokens/s (not run by default)

treespec methods run once per backend ("linear[native]", "linear[hf]", ...) and, given several
verification rules, once per rule that applies to the method's tree ("linear/block[native]";
"auto" = the decoder's default, the best rule that applies). Runs are
interleaved (repeat -> prompt -> method) so that slow drifts of the machine hit every method
alike; each method's tokens/s is the median over its runs. Forward costs are measured through
the runners (synchronising on CUDA): t(1), t(n)/t(1), c = t_draft(1)/t_target(1), and the
floor: weight bytes / measured memory bandwidth, as a ratio to the measured t(1).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .backends import Runner, cpu_bf16_flags, cpu_model, make_runner
from .backends.subset import VocabMap, full_vocabulary_model, wrap
from .config import SamplingConfig, TreeConfig, check_positive_int
from .decoder import SpeculativeDecoder
from .llamacpp import LlamaCppBench
from .request import encode_prompt
from .stats import GenerationStats
from .tree import TokenTree
from .verify import rule_name

METHODS = ("hf", "hf-assisted", "autoregressive", "linear", "tree")  # what a bench runs by default
KNOWN_METHODS = (*METHODS, "goodput")


@dataclass
class MethodResult:
    method: str
    tokens_per_second: float  # median over runs of (new tokens / wall seconds)
    tokens_per_step: float | None = None  # treespec only: total tokens / total target forwards
    acceptance_by_depth: list[float] | None = None  # treespec only, pooled over runs
    acceptance_rate: float | None = None  # treespec only: accepted draft tokens / drafted tokens, pooled
    mean_accepted_length: float | None = None  # treespec only: accepted draft tokens per target step
    draft_forwards: int | None = None  # treespec only: draft model forwards, summed over runs
    # treespec only, timed inside generate(): c as a round pays it, (draft seconds per draft
    # forward, sampling included) / (verify seconds per target step, the walk included)
    c_in_loop: float | None = None
    runs: list[float] = field(default_factory=list)  # tokens/s of every run


@dataclass
class BenchResult:
    config: dict  # what was run (models, dtype, tree, sampling, sizes)
    cost: dict  # per backend: t(1), t(n)/t(1), c = t_draft/t_target, floor (see measure_costs)
    methods: list[MethodResult]

    def to_json(self) -> dict:
        return asdict(self)


def machine_info(device: torch.device | str = "cpu") -> dict:
    """What a measurement ran on, for its JSON and its report: the device (CPU model or GPU
    name), the CPU's bf16 matrix flags, torch threads and versions."""
    device = torch.device(device)
    return {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model(),
        "cpu_bf16_flags": sorted(cpu_bf16_flags()),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def chain_logits(runner: Runner, ids: list[int], cont: list[int]) -> torch.Tensor:
    """The `runner`'s next-token logits [len(cont), V] at the positions that predict each token of `cont`
    when `cont` follows the prompt `ids` (teacher forcing; the cache is reset first)."""
    runner.reset()
    runner.prefill(ids[:-1])
    logits = runner.extend([ids[-1]] + cont[:-1], list(range(-1, len(cont) - 1)))
    runner.commit([])
    return logits


def forward_seconds(runner: Runner, n_nodes: int = 1, prefix_len: int = 128, repeats: int = 20) -> float:
    """Median seconds of one `score()` of an `n_nodes` tree after a `prefix_len` prefix."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, runner.vocab_size, (prefix_len + n_nodes,), generator=g).tolist()
    tree = TokenTree(tokens[prefix_len:], [-1] + [0] * (n_nodes - 1))  # the root and n-1 children
    runner.reset()
    runner.prefill(tokens[:prefix_len])
    times = []
    for _ in range(repeats + 2):  # two warm-up calls
        _sync(runner.device)
        t0 = time.perf_counter()
        runner.score(tree)
        _sync(runner.device)
        times.append(time.perf_counter() - t0)
        runner.commit([])
    return statistics.median(times[2:])


def memory_bandwidth(device: torch.device, mbytes: int = 256, repeats: int = 10) -> float:
    """Bytes/s of a large device copy (read + write), median of `repeats`."""
    x = torch.empty(mbytes * 2**20 // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * x.numel() * 4 / statistics.median(times)


def measure_costs(target: Runner, draft: Runner | None, n_nodes: int, weight_bytes: int) -> dict:
    """t(1), t(n)/t(1), c and the bandwidth floor of one backend's runners."""
    t1 = forward_seconds(target)
    cost = {"t_target_1_s": t1, f"t_target_{n_nodes}_s": forward_seconds(target, n_nodes)}
    cost[f"t({n_nodes})/t(1)"] = cost[f"t_target_{n_nodes}_s"] / t1
    if draft is not None:
        cost["t_draft_1_s"] = forward_seconds(draft)
        cost["c"] = cost["t_draft_1_s"] / t1
    floor = weight_bytes / memory_bandwidth(target.device)
    cost["floor_s"], cost["floor/t(1)"] = floor, floor / t1
    return cost


def native_runners(
    target,
    draft,
    compile: bool = False,
    quantize: str | None = None,
    draft_quantize: str | None = None,
    draft_vocab: VocabMap | None = None,
    target_dir: Path | None = None,
) -> dict[str, tuple[Runner, Runner]]:
    """`run_bench(runners=...)` for the native backend alone, with the options only it has:
    inductor graphs and weight-only quantization of the target and/or the draft (a subset draft
    wrapped by `draft_vocab`). `target_dir`: the target's checkpoint directory, read instead of
    the HF model's weights (a GGUF conversion's int4 blocks are there, not in the model)."""
    from .backends.native import NativeRunner

    if target_dir is None:
        target_runner = NativeRunner.from_hf(target, compile=compile, quantize=quantize)
    else:
        param = next(target.parameters())  # the dtype and device the HF model was loaded in
        target_runner = NativeRunner.from_pretrained(
            target_dir, param.dtype, param.device, compile=compile, quantize=quantize
        )
    return {
        "native": (
            target_runner,
            wrap(NativeRunner.from_hf(draft, compile=compile, quantize=draft_quantize), draft_vocab),
        )
    }


def run_bench(
    target,
    draft,
    tokenizer,
    prompts: Sequence,
    max_new_tokens: int,
    tree: TreeConfig,
    sampling: SamplingConfig,
    repeats: int = 3,
    methods: Sequence[str] = METHODS,
    backends: Sequence[str] = ("native", "hf"),
    drafter: str = "model",
    progress: Callable[[str], None] | None = None,
    config: dict | None = None,
    verifications: Sequence[str] = ("auto",),
    batch_size: int = 1,
    compile: bool = False,
    draft_vocab: VocabMap | None = None,
    runners: dict[str, tuple[Runner, Runner | None]] | None = None,
    llama_cpp: LlamaCppBench | None = None,
    warmup: bool = False,
) -> BenchResult:
    """Benchmark HF causal LMs `target` and `draft` (HF generate runs them directly; treespec
    wraps them once per backend). `prompts`: text or chats (need `tokenizer`) or token ids.
    `compile`: treespec's native runners use their inductor forward (HF's models are as
    loaded). `draft_vocab`: the draft has a subset vocabulary (`backends.subset`): treespec
    wraps it, and HF assisted generation runs its full-vocabulary equivalent (the same q).
    `runners`: treespec's (target, draft) runners per backend, built once and shared by several
    runs (compiled runners compile once); default: made here from `target` and `draft`.
    `llama_cpp`: llama.cpp's binaries and GGUF files; its plain (and, with a draft GGUF,
    speculative, drafting up to the tree's depth) decoding run interleaved with the others on
    the same prompts, as text (the decoded token ids, special tokens kept). The config records
    how many of its runs tokenized a prompt to another length than treespec's ids.

    `batch_size` > 1 times batches instead of single prompts: the prompts, cycled, form
    batches of `batch_size` requests (ceil(len(prompts) / batch_size) of them); HF runs each as
    one left-padded `generate()`, treespec as one `generate_batch()`; tokens/s counts every
    request's tokens over the batch's wall time. HF assisted generation cannot batch and is
    not run then, nor is llama.cpp.

    `warmup`: before timing, every treespec method decodes every prompt once, untimed, so that
    compiled runners have compiled the graphs of every feed size the run will meet (a tree at
    T=1 meets several; each compiles on first use, a minute apiece)."""
    check_positive_int("batch_size", batch_size)
    if batch_size > 1:
        methods = [m for m in methods if m != "hf-assisted"]
        llama_cpp = None
    assistant = draft
    if draft_vocab is not None and "hf-assisted" in methods:
        assistant = full_vocabulary_model(draft, draft_vocab)
    unknown = set(methods) - set(KNOWN_METHODS)
    if unknown:
        raise ValueError(f"unknown bench methods {sorted(unknown)}; choose from {', '.join(KNOWN_METHODS)}")
    prompts = [list(encode_prompt(p, tokenizer)) for p in prompts]  # text and chats -> token ids
    if not verifications:
        raise ValueError("give at least one verification rule (auto, token, block, traversal)")
    for v in verifications:
        rule_name(v)

    def draft_runner(backend: str) -> Runner:
        runner = make_runner(draft, backend, compile)
        return wrap(runner, draft_vocab)

    runners = runners or {b: (make_runner(target, b, compile), draft_runner(b)) for b in backends}
    decoders = {b: SpeculativeDecoder(*runners[b], tokenizer, drafter=drafter, backend=b) for b in backends}
    n_batches = -(-len(prompts) // batch_size)
    batches = [
        [prompts[(j * batch_size + k) % len(prompts)] for k in range(batch_size)] for j in range(n_batches)
    ]
    encoded = [
        encode_batch(tokenizer, batch, target.device) for batch in batches
    ]  # per batch: input_ids, attention_mask
    # linear: a chain of the tree's depth (a Sequoia shape's chain is its depth, drafted i.i.d.)
    linear = TreeConfig(1, tree.depth, "iid" if tree.strategy in ("sequoia", "dynamic") else tree.strategy)
    goodput = dataclasses.replace(linear, plain_fallback=True)
    trees = {"autoregressive": None, "linear": linear, "tree": tree, "goodput": goodput}
    hf_kwargs = dict(
        max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=_pad_id(tokenizer)
    )
    if sampling.greedy:
        hf_kwargs.update(do_sample=False)
    else:
        hf_kwargs.update(
            do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p
        )

    rules = {}  # treespec method name -> (method, rule or None for the default)
    for b in backends:
        for m in methods:
            if m.startswith("hf"):
                continue
            fits = decoders[b].rules(trees[m])
            for v in verifications if m != "autoregressive" else ("auto",):
                if v != "auto" and v not in fits:
                    continue  # e.g. block on a tree: not applicable, not run
                name = m if len(verifications) == 1 or m == "autoregressive" else f"{m}/{v}"
                rules[f"{name}[{b}]"] = (m, None if v == "auto" else v)
    external = llama_cpp.methods if llama_cpp is not None else []
    names = [m for m in methods if m.startswith("hf")] + external + list(rules)
    runs: dict[str, list[float]] = {m: [] for m in names}
    totals = {m: GenerationStats() for m in names}  # treespec methods: pooled over runs
    drafted = {m: [0, 0] for m in external}  # llama.cpp: drafted, accepted
    prompt_mismatches = 0  # llama.cpp runs whose prompt tokenized to another length

    def decode(name: str, ids, attention, seed: int) -> tuple[list, float]:
        """One treespec method on one batch: its outputs and wall seconds."""
        backend = name[:-1].split("[")[1]
        method, rule = rules[name]
        requests = [row[mask.bool()].tolist() for row, mask in zip(ids, attention)]  # padding dropped
        t0 = time.perf_counter()
        if batch_size == 1:
            outs = [
                decoders[backend].generate(
                    requests[0],
                    max_new_tokens,
                    tree=trees[method],
                    sampling=sampling,
                    seed=seed,
                    ignore_eos=True,
                    verification=rule,
                )
            ]
        else:
            outs = decoders[backend].generate_batch(
                requests,
                max_new_tokens,
                tree=trees[method],
                sampling=sampling,
                verification=rule,
                seeds=[seed + k for k in range(batch_size)],
                ignore_eos=True,
                max_batch=batch_size,
            )
        _sync(target.device)
        return outs, time.perf_counter() - t0

    if warmup:
        for i, (ids, attention) in enumerate(encoded):
            for name in rules:
                if progress:
                    progress(f"warm-up batch {i + 1}/{len(encoded)} {name}")
                decode(name, ids, attention, seed=10**6 + i)  # seeds the timed runs do not use
    for rep in range(repeats):
        for i, (ids, attention) in enumerate(encoded):
            for name in names:
                if progress:
                    progress(f"repeat {rep + 1}/{repeats} batch {i + 1}/{len(encoded)} {name}")
                seed = rep * 1000 + i * batch_size
                if name.startswith("hf"):
                    extra = {"assistant_model": assistant} if name == "hf-assisted" else {}
                    torch.manual_seed(seed)
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        out = target.generate(ids, attention_mask=attention, **hf_kwargs, **extra)
                    _sync(target.device)
                    runs[name].append(out[:, ids.shape[1] :].numel() / (time.perf_counter() - t0))
                    continue
                if name in external:
                    row = ids[0][attention[0].bool()].tolist()
                    text = tokenizer.decode(row, skip_special_tokens=False)
                    temperature = 0.0 if sampling.greedy else sampling.temperature
                    run = llama_cpp.run(name, text, max_new_tokens, temperature, seed, tree.depth)
                    runs[name].append(run.tokens_per_second)
                    prompt_mismatches += run.prompt_tokens != len(row)
                    if run.drafted is not None:
                        drafted[name][0] += run.drafted
                        drafted[name][1] += run.accepted
                    continue
                outs, seconds = decode(name, ids, attention, seed)
                runs[name].append(sum(o.stats.tokens for o in outs) / seconds)
                for o in outs:
                    totals[name].add(o.stats)
    results = []
    for name in names:
        r = MethodResult(name, statistics.median(runs[name]), runs=runs[name])
        if name in external:
            r.acceptance_rate = drafted[name][1] / drafted[name][0] if drafted[name][0] else None
        elif not name.startswith("hf"):
            t = totals[name]
            r.tokens_per_step = t.tokens_per_step
            r.acceptance_by_depth = t.acceptance_by_depth
            r.acceptance_rate = t.acceptance_rate
            r.mean_accepted_length = t.mean_accepted_length
            r.draft_forwards = t.draft_forwards
            if t.draft_forwards and t.target_steps and t.verify_seconds:
                r.c_in_loop = (t.draft_seconds / t.draft_forwards) / (t.verify_seconds / t.target_steps)
        results.append(r)
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    n_tree = 1 + tree.width * tree.depth
    cost = {
        b: measure_costs(d.target_runner, d.draft_runner, n_tree, weight_bytes) for b, d in decoders.items()
    }
    config = {**(config or {}), "batch_size": batch_size}
    if llama_cpp is not None:
        config["llama_cpp"] = {
            "binary": str(llama_cpp.llama.decode_binary),
            "gguf": str(llama_cpp.gguf),
            "draft_gguf": str(llama_cpp.draft_gguf) if llama_cpp.draft_gguf else None,
            "prompt_length_mismatches": prompt_mismatches,
        }
    return BenchResult(config=config, cost=cost, methods=results)


def result_table(result: BenchResult) -> str:
    """The bench's table: one row per method (speedup over HF `generate()` where it ran), then
    each backend's forward costs."""
    base = next((r.tokens_per_second for r in result.methods if r.method == "hf"), None)
    header = f"{'method':<30}{'tokens/s':>10}{'speedup':>9}{'tokens/step':>13}{'accept':>8}{'acc.len':>9}"
    lines = [header + f"{'c loop':>8}  acceptance by depth"]
    for r in result.methods:
        speed = f"{r.tokens_per_second / base:.2f}x" if base else "-"
        tps = f"{r.tokens_per_step:.2f}" if r.tokens_per_step is not None else "-"
        rate = f"{r.acceptance_rate:.2f}" if r.acceptance_rate else "-"
        length = f"{r.mean_accepted_length:.2f}" if r.acceptance_rate and r.mean_accepted_length else "-"
        acc = " ".join(f"{a:.2f}" for a in r.acceptance_by_depth or [])
        c = f"{r.c_in_loop:.3f}" if r.c_in_loop is not None else "-"
        lines.append(
            f"{r.method:<30}{r.tokens_per_second:>10.1f}{speed:>9}{tps:>13}{rate:>8}{length:>9}{c:>8}  {acc}"
        )
    for backend, cost in result.cost.items():
        lines.append(f"cost [{backend}]: " + ", ".join(f"{k}={v:.4g}" for k, v in cost.items()))
    return "\n".join(lines)


def encode_batch(
    tokenizer, prompts: Sequence[str | Sequence[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of prompts (token ids, or text) as left-padded input_ids and attention_mask
    [B, S] (what HF `generate()` of a decoder-only model expects; the pad id never reaches a
    model row)."""
    rows = [tokenizer(p)["input_ids"] if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    width, pad = max(map(len, rows)), _pad_id(tokenizer)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)  # [B, S]
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)  # [B, S]
    return ids, mask


def _pad_id(tokenizer) -> int:
    return getattr(tokenizer, "pad_token_id", None) or 0
