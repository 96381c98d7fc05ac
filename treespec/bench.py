"""Speed comparison in one process: treespec against Hugging Face `generate()`.

Methods (all on the same target/draft, same prompts, same max_new_tokens):

    hf            target.generate()                         plain HF decoding
    hf-assisted   target.generate(assistant_model=draft)    HF's linear speculative decoding
    autoregressive  treespec, tree=None                     the in-library baseline
    linear        treespec, TreeConfig(width=1, depth)
    tree          treespec, TreeConfig(width, depth, strategy)

Runs are interleaved (repeat -> prompt -> method) so that slow drifts of the machine hit
every method alike; each method's tokens/s is the median over its runs. The function returns
numbers; the CLI prints them and writes JSON.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from .config import SamplingConfig, TreeConfig
from .decoder import SpeculativeDecoder
from .stats import GenerationStats

METHODS = ("hf", "hf-assisted", "autoregressive", "linear", "tree")


@dataclass
class MethodResult:
    method: str
    tokens_per_second: float  # median over runs of (new tokens / wall seconds)
    tokens_per_step: float | None = None  # treespec only: total tokens / total target forwards
    acceptance_by_depth: list[float] | None = None  # treespec only, pooled over runs
    runs: list[float] = field(default_factory=list)  # tokens/s of every run


@dataclass
class BenchResult:
    config: dict  # what was run (models, dtype, tree, sampling, sizes)
    cost: dict  # c = t_draft / t_target and t(n)/t(1), measured per forward
    methods: list[MethodResult]

    def to_json(self) -> dict:
        return asdict(self)


def forward_latency(model, prefix_len: int = 128, n_nodes: int = 1, repeats: int = 10) -> float:
    """Median seconds of one cached forward of `n_nodes` tokens after a `prefix_len` prefix."""
    from transformers import DynamicCache

    ids = torch.randint(0, model.config.vocab_size, (1, prefix_len + n_nodes), device=model.device)
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            cache = DynamicCache(config=model.config)
            model(ids[:, :prefix_len], past_key_values=cache, use_cache=True)
            t0 = time.perf_counter()
            model(ids[:, prefix_len:], past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_bench(
    dec: SpeculativeDecoder,
    prompts: Sequence[str],
    max_new_tokens: int,
    tree: TreeConfig,
    sampling: SamplingConfig,
    repeats: int = 3,
    methods: Sequence[str] = METHODS,
    progress: Callable[[str], None] | None = None,
    config: dict | None = None,
) -> BenchResult:
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown bench methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    target, draft, tok = dec.target_model, dec.draft_model, dec.tokenizer
    if tok is None:
        raise ValueError("bench needs a tokenizer for its text prompts")
    encoded = [tok(p, return_tensors="pt")["input_ids"].to(target.device) for p in prompts]
    trees = {"autoregressive": None, "linear": TreeConfig(1, tree.depth, tree.strategy), "tree": tree}
    hf_kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id or 0)
    if sampling.greedy:
        hf_kwargs.update(do_sample=False)
    else:
        hf_kwargs.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p)

    runs: dict[str, list[float]] = {m: [] for m in methods}
    totals = {m: GenerationStats() for m in methods}  # treespec methods: pooled over runs
    for rep in range(repeats):
        for i, ids in enumerate(encoded):
            for m in methods:
                if progress:
                    progress(f"repeat {rep + 1}/{repeats} prompt {i + 1}/{len(encoded)} {m}")
                if m.startswith("hf"):
                    extra = {"assistant_model": draft} if m == "hf-assisted" else {}
                    torch.manual_seed(rep * 1000 + i)
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        out = target.generate(ids, **hf_kwargs, **extra)
                    dt = time.perf_counter() - t0
                    runs[m].append((out.shape[1] - ids.shape[1]) / dt)
                else:
                    out = dec.generate(ids[0].tolist(), max_new_tokens, tree=trees[m], sampling=sampling, seed=rep * 1000 + i, ignore_eos=True)
                    runs[m].append(out.stats.tokens / out.stats.total_seconds)
                    totals[m].add(out.stats)
    results = []
    for m in methods:
        r = MethodResult(m, statistics.median(runs[m]), runs=runs[m])
        if not m.startswith("hf"):
            r.tokens_per_step = totals[m].tokens_per_step
            r.acceptance_by_depth = totals[m].acceptance_by_depth
        results.append(r)
    n_tree = 1 + tree.width * tree.depth
    cost = {
        "t_target_s": forward_latency(target),
        "t_draft_s": forward_latency(draft),
        f"t_target_{n_tree}_nodes_s": forward_latency(target, n_nodes=n_tree),
    }
    cost["c"] = cost["t_draft_s"] / cost["t_target_s"]
    cost[f"t({n_tree})/t(1)"] = cost[f"t_target_{n_tree}_nodes_s"] / cost["t_target_s"]
    return BenchResult(config=dict(config or {}), cost=cost, methods=results)
