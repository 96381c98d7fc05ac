"""`run_bench`: treespec's methods, HF `generate()` and llama.cpp timed on the same models,
prompts and max_new_tokens, interleaved (repeat -> batch -> method) so that slow drifts of the
machine hit every method alike; each method's tokens/s is the median over its runs."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..backends import Runner, make_runner
from ..backends.subset import VocabMap, full_vocabulary_model, wrap
from ..config import SamplingConfig, TreeConfig, check_positive_int
from ..decoder import SpeculativeDecoder
from ..request import encode_prompt
from ..rules import rule_name
from ..stats import GenerationStats
from .llamacpp import LlamaCppBench
from .measure import cost_ratios, synchronize
from .results import KNOWN_METHODS, METHODS, BenchResult, MethodResult


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
    from ..backends.native import NativeRunner

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
    T=1 meets several; each compiles on first use)."""
    check_positive_int("batch_size", batch_size)
    if batch_size > 1:
        methods = [m for m in methods if m != "hf-assisted"]
        llama_cpp = None
    assistant = draft
    if draft_vocab is not None and "hf-assisted" in methods:
        assistant = full_vocabulary_model(draft, draft_vocab)
    check_methods(methods)
    prompts = [list(encode_prompt(p, tokenizer)) for p in prompts]  # text and chats -> token ids
    check_verifications(verifications)
    runners = runners or {b: runners_of(target, draft, b, compile, draft_vocab) for b in backends}
    decoders = {b: SpeculativeDecoder(*runners[b], tokenizer, drafter=drafter, backend=b) for b in backends}
    bench = _Bench(
        target=target,
        assistant=assistant,
        tokenizer=tokenizer,
        decoders=decoders,
        trees=compared_trees(tree),
        sampling=sampling,
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        draft_max=tree.depth,
        llama_cpp=llama_cpp,
    )
    bench.plan(methods, verifications)
    encoded = [encode_batch(tokenizer, b, target.device) for b in cycled_batches(prompts, batch_size)]
    if warmup:
        bench.warm_up(encoded, progress)
    bench.run(encoded, repeats, progress)
    config = {**(config or {}), "batch_size": batch_size}
    if llama_cpp is not None:
        config["llama_cpp"] = llama_cpp_config(llama_cpp, bench.prompt_mismatches)
    return BenchResult(config=config, cost=backend_costs(decoders, target, tree), methods=bench.results())


def runners_of(target, draft, backend: str, compile: bool, draft_vocab: VocabMap | None):
    """(target, draft) runners of `backend` over the HF models (a subset draft wrapped)."""
    return make_runner(target, backend, compile), wrap(make_runner(draft, backend, compile), draft_vocab)


def check_methods(methods: Sequence[str]) -> None:
    unknown = set(methods) - set(KNOWN_METHODS)
    if unknown:
        raise ValueError(f"unknown bench methods {sorted(unknown)}; choose from {', '.join(KNOWN_METHODS)}")


def check_verifications(verifications: Sequence[str]) -> None:
    if not verifications:
        raise ValueError("give at least one verification rule (auto, token, block, traversal)")
    for v in verifications:
        rule_name(v)


def cycled_batches(prompts: list[list[int]], batch_size: int) -> list[list[list[int]]]:
    """The prompts, cycled, as ceil(len(prompts) / batch_size) batches of `batch_size`."""
    n_batches = -(-len(prompts) // batch_size)
    return [
        [prompts[(j * batch_size + k) % len(prompts)] for k in range(batch_size)] for j in range(n_batches)
    ]


def compared_trees(tree: TreeConfig) -> dict[str, TreeConfig | None]:
    """Each treespec method's tree. linear: a chain of the tree's depth (a Sequoia shape's
    chain is its depth, drafted i.i.d.); goodput: that chain with plain_fallback."""
    linear = TreeConfig(1, tree.depth, "iid" if tree.strategy in ("sequoia", "dynamic") else tree.strategy)
    goodput = dataclasses.replace(linear, plain_fallback=True)
    return {"autoregressive": None, "linear": linear, "tree": tree, "goodput": goodput}


def hf_generate_kwargs(tokenizer, sampling: SamplingConfig, max_new_tokens: int) -> dict:
    """HF `generate()`'s arguments for exactly `max_new_tokens` tokens sampled as `sampling`."""
    kwargs = dict(
        max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=_pad_id(tokenizer)
    )
    if sampling.greedy:
        kwargs.update(do_sample=False)
    else:
        kwargs.update(
            do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p
        )
    return kwargs


def backend_costs(decoders: dict[str, SpeculativeDecoder], target, tree: TreeConfig) -> dict[str, dict]:
    """Each backend's `cost_ratios`, for a tree of 1 + width x depth nodes."""
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    n_tree = 1 + tree.width * tree.depth
    costs = {}
    for backend, decoder in decoders.items():
        costs[backend] = cost_ratios(decoder.target_runner, decoder.draft_runner, n_tree, weight_bytes)
    return costs


def llama_cpp_config(llama_cpp: LlamaCppBench, prompt_mismatches: int) -> dict:
    return {
        "binary": str(llama_cpp.llama.decode_binary),
        "gguf": str(llama_cpp.gguf),
        "draft_gguf": str(llama_cpp.draft_gguf) if llama_cpp.draft_gguf else None,
        "prompt_length_mismatches": prompt_mismatches,
    }


@dataclasses.dataclass
class _Bench:
    """One bench's methods and their runs: `plan` names the rows, `warm_up` and `run` run
    them, `results` reports them."""

    target: object
    assistant: object  # what HF assisted generation drafts with
    tokenizer: object
    decoders: dict[str, SpeculativeDecoder]
    trees: dict[str, TreeConfig | None]
    sampling: SamplingConfig
    max_new_tokens: int
    batch_size: int
    draft_max: int  # llama.cpp's speculative decoding drafts up to the tree's depth
    llama_cpp: LlamaCppBench | None
    names: list[str] = dataclasses.field(default_factory=list)  # every row, in order
    rules: dict = dataclasses.field(default_factory=dict)  # treespec row -> (method, rule or None)
    runs: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # row -> tokens/s per run
    totals: dict[str, GenerationStats] = dataclasses.field(default_factory=dict)  # treespec rows, pooled
    drafted: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # llama.cpp: drafted, accepted
    prompt_mismatches: int = 0  # llama.cpp runs whose prompt tokenized to another length

    @property
    def external(self) -> list[str]:
        return self.llama_cpp.methods if self.llama_cpp is not None else []

    def plan(self, methods: Sequence[str], verifications: Sequence[str]) -> None:
        """The rows: HF's, llama.cpp's, then each treespec method per backend and per rule that
        applies to its tree ("linear/block[native]"; "auto" = the decoder's default)."""
        for b, decoder in self.decoders.items():
            for m in methods:
                if m.startswith("hf"):
                    continue
                fits = decoder.rules(self.trees[m])
                for v in verifications if m != "autoregressive" else ("auto",):
                    if v != "auto" and v not in fits:
                        continue  # e.g. block on a tree: not applicable, not run
                    name = m if len(verifications) == 1 or m == "autoregressive" else f"{m}/{v}"
                    self.rules[f"{name}[{b}]"] = (m, None if v == "auto" else v)
        self.names = [m for m in methods if m.startswith("hf")] + self.external + list(self.rules)
        self.runs = {m: [] for m in self.names}
        self.totals = {m: GenerationStats() for m in self.names}
        self.drafted = {m: [0, 0] for m in self.external}

    def warm_up(self, encoded: list, progress: Callable[[str], None] | None) -> None:
        """Every treespec row decodes every batch once, untimed."""
        for i, (ids, attention) in enumerate(encoded):
            for name in self.rules:
                if progress:
                    progress(f"warm-up batch {i + 1}/{len(encoded)} {name}")
                self.decode(name, ids, attention, seed=10**6 + i)  # seeds the timed runs do not use

    def run(self, encoded: list, repeats: int, progress: Callable[[str], None] | None) -> None:
        """Every row on every batch, `repeats` times, interleaved: repeat -> batch -> row."""
        for rep in range(repeats):
            for i, (ids, attention) in enumerate(encoded):
                for name in self.names:
                    if progress:
                        progress(f"repeat {rep + 1}/{repeats} batch {i + 1}/{len(encoded)} {name}")
                    seed = rep * 1000 + i * self.batch_size
                    if name.startswith("hf"):
                        self.time_hf(name, ids, attention, seed)
                    elif name in self.external:
                        self.time_llama_cpp(name, ids, attention, seed)
                    else:
                        self.time_treespec(name, ids, attention, seed)

    def time_hf(self, name: str, ids: torch.Tensor, attention: torch.Tensor, seed: int) -> None:
        """One HF `generate()` (assisted for "hf-assisted") of a batch [B, S]."""
        extra = {"assistant_model": self.assistant} if name == "hf-assisted" else {}
        kwargs = hf_generate_kwargs(self.tokenizer, self.sampling, self.max_new_tokens)  # untimed
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.target.generate(ids, attention_mask=attention, **kwargs, **extra)
        synchronize(self.target.device)
        self.runs[name].append(out[:, ids.shape[1] :].numel() / (time.perf_counter() - t0))

    def time_llama_cpp(self, name: str, ids: torch.Tensor, attention: torch.Tensor, seed: int) -> None:
        """One llama.cpp run of the batch's one prompt, as text."""
        row = ids[0][attention[0].bool()].tolist()
        text = self.tokenizer.decode(row, skip_special_tokens=False)
        temperature = 0.0 if self.sampling.greedy else self.sampling.temperature
        run = self.llama_cpp.run(name, text, self.max_new_tokens, temperature, seed, self.draft_max)
        self.runs[name].append(run.tokens_per_second)
        self.prompt_mismatches += run.prompt_tokens != len(row)
        if run.drafted is not None:
            self.drafted[name][0] += run.drafted
            self.drafted[name][1] += run.accepted

    def time_treespec(self, name: str, ids: torch.Tensor, attention: torch.Tensor, seed: int) -> None:
        outs, seconds = self.decode(name, ids, attention, seed)
        self.runs[name].append(sum(o.stats.tokens for o in outs) / seconds)
        for o in outs:
            self.totals[name].add(o.stats)

    def decode(self, name: str, ids: torch.Tensor, attention: torch.Tensor, seed: int) -> tuple[list, float]:
        """One treespec row on one batch [B, S]: its outputs and wall seconds."""
        backend = name[:-1].split("[")[1]
        method, rule = self.rules[name]
        decoder, tree = self.decoders[backend], self.trees[method]
        requests = [row[mask.bool()].tolist() for row, mask in zip(ids, attention)]  # padding dropped
        common = dict(tree=tree, sampling=self.sampling, verification=rule, ignore_eos=True)
        t0 = time.perf_counter()
        if self.batch_size == 1:
            outs = [decoder.generate(requests[0], self.max_new_tokens, seed=seed, **common)]
        else:
            seeds = [seed + k for k in range(self.batch_size)]
            outs = decoder.generate_batch(
                requests, self.max_new_tokens, seeds=seeds, max_batch=self.batch_size, **common
            )
        synchronize(self.target.device)
        return outs, time.perf_counter() - t0

    def results(self) -> list[MethodResult]:
        """One row per method: its median tokens/s, and what it pooled over its runs."""
        results = []
        for name in self.names:
            r = MethodResult(name, statistics.median(self.runs[name]), runs=self.runs[name])
            if name in self.external:
                drafted, accepted = self.drafted[name]
                r.acceptance_rate = accepted / drafted if drafted else None
            elif not name.startswith("hf"):
                t = self.totals[name]
                r.tokens_per_step = t.tokens_per_step
                r.acceptance_by_depth = t.acceptance_by_depth
                r.acceptance_rate = t.acceptance_rate
                r.mean_accepted_length = t.mean_accepted_length
                r.draft_forwards = t.draft_forwards
                if t.draft_forwards and t.target_steps and t.verify_seconds:
                    r.c_in_loop = (t.draft_seconds / t.draft_forwards) / (t.verify_seconds / t.target_steps)
            results.append(r)
        return results


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
