"""`SpeculativeDecoder`: the facade users start from. It loads (`treespec.loading`), builds
`Request`s from what users pass (`treespec.request`) and runs them on an `Engine`.

    generate(prompt, ...)          one request on the decoder's own runners
    generate_batch(prompts, ...)   many requests, one target forward per round for all
    engine(max_live, ...)          the continuous-batching loop itself, with lanes of its own

A decoder runs one `generate()` / `generate_batch()` at a time: a second call while one runs
(from another thread, or from inside a streaming callback) raises at once instead of sharing
the caches. Engines own their lanes, so several engines of one decoder never share a cache.
No transformers import and no cache arithmetic here.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

from .backends import Runner, make_runner
from .config import SamplingConfig, TreeConfig, check_int_at_least, check_positive_int
from .drafters import Drafter, DrafterFactory
from .engine import Engine
from .output import GenerationOutput, OnTokens
from .planning import Costs, GoodputSwitch, Planner, measure_costs, planner_for
from .prefill import DEFAULT_ROUND_TOKENS
from .request import make_request
from .rng import Rng
from .rules import rules_for
from .vocab import compare_tokenizers, shared_support


class SpeculativeDecoder:
    """Lossless tree speculative decoding of `target`, drafted by `draft`.

    `target` and `draft` are Hugging Face causal LMs (loaded with an attention implementation
    that honours 4D masks: "sdpa" or "eager") or treespec `Runner`s. `draft` may be None for
    plain decoding (`tree=None`) and for model-free drafters.

    `drafter` chooses who proposes the tree:
      "model"   the draft model, shaped by `TreeConfig` (default)
      "ngram"   `NgramDrafter(width)`: n-gram tables over the sequence, no draft model
      "lookup"  `PromptLookupDrafter(width)`: continuations of earlier matches in the context
      "merged"  the draft model's tree and the n-gram tree merged into one
      "head"    a feature head (EAGLE-3) drafting from the target's hidden states; the
                default when `draft` is a head (`treespec.backends.head.HeadRunner`)
      a `Drafter` instance: used as it is; `TreeConfig.depth` still caps each round's depth

    `backend` runs HF models: "native" (treespec's static-cache Llama forward), "hf" (the
    model's own modules over a DynamicCache) or "auto": native where the architecture is
    supported, else hf with a one-line notice. Runners are used as given.
    """

    def __init__(
        self,
        target,
        draft=None,
        tokenizer=None,
        drafter: str | Drafter = "model",
        backend: str = "auto",
        draft_tokenizer=None,
    ):
        if target is None:
            raise ValueError("target is None; pass a Hugging Face causal LM or a treespec Runner")
        for name, model in (("target", target), ("draft", draft), ("tokenizer", tokenizer)):
            if isinstance(model, (str, os.PathLike)):
                raise ValueError(
                    f"{name} is a path ({str(model)!r}), not a loaded object; use "
                    f"SpeculativeDecoder.from_pretrained(target=..., draft=...) to load from paths or hub ids"
                )
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(
                "tokenizer must be a Hugging Face tokenizer (callable, with decode()), got "
                f"{type(tokenizer).__name__}"
            )
        self.tokenizer = tokenizer
        self.target_runner: Runner = make_runner(target, backend)
        self.draft_runner: Runner | None = None if draft is None else make_runner(draft, backend)
        self.vocab_size = self.target_runner.vocab_size  # q is a distribution over the target's rows
        compare_tokenizers(tokenizer, draft_tokenizer)
        # ids q may put mass on: the real tokens both models know (padding rows excluded)
        self.draft_support = (
            None
            if self.draft_runner is None
            else shared_support(
                self.vocab_size,
                self.draft_runner.vocab_size,
                tokenizer if tokenizer is not None else draft_tokenizer,
            )
        )
        if drafter == "model" and self.draft_runner is not None and self.draft_runner.takes_hidden:
            drafter = "head"  # a feature head drafts from the target's features
        self.drafter = DrafterFactory(drafter, self.vocab_size, self.draft_support)
        self.eos_token_ids = frozenset(self.target_runner.eos_token_ids)
        self._busy = threading.Lock()  # held while generate() / generate_batch() runs
        self._batch_lanes: tuple[int, list[Runner], list[Runner | None]] | None = None  # see _lanes()
        self._goodput: GoodputSwitch | None = None  # speculate_max_live="auto", kept across engines
        # the automatic tree (TreeConfig()): what from_pretrained loaded (None: objects) and the
        # draft's shipped acceptance, read by `planner`
        self._origin: dict | None = None
        self._shipped_acceptance = None
        self._planner: Planner | None = None

    @classmethod
    def from_pretrained(
        cls,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        dtype: torch.dtype | str = "auto",
        device: torch.device | str | None = None,
        backend: str = "auto",
        drafter: str | Drafter | None = None,
        draft_dtype: torch.dtype | str | None = None,
        compile: bool | str = "auto",
        quantize: str | None = "auto",
        draft_quantize: str | None = "auto",
        tp: int | None = None,
    ) -> SpeculativeDecoder:
        """Load target, draft and the target's tokenizer: local directories, GGUF files or HF ids.

        With no arguments, loads the bundled pair (see `treespec.zoo`), drafting with its feature
        head where it ships one (`drafter=None`; "model" for its draft model). `dtype="auto"` is
        bf16 on CUDA; on a CPU, bf16 for the target where the CPU has AMX or AVX512-BF16 and
        bf16 products measure faster, or where it runs a GGUF file's 4-bit blocks faster in bf16
        (`quantize` below), fp32 for the draft (`treespec.backends.auto_dtype`); a
        feature head runs in the target's dtype. `draft_dtype` overrides the draft's (default:
        `dtype`). `device` defaults to the CPU. The native backend reads the weights straight
        from safetensors; `compile=True` runs its forwards as inductor graphs, compiled once for
        this machine and model (minutes) and kept; `compile="auto"` (the default) runs the
        graphs already kept, where quantized weights have them, and the eager forward otherwise
        (`compiled` says which; docs/performance.md); `compile=False` always the eager one.
        `quantize` / `draft_quantize` ("int8", "int4", "q4q8"; native backend): weight-only int8 or int4
        for the target / the draft (a draft model or a feature head). A quantized draft is still
        lossless; `draft_quantize="auto"` (the default) runs a feature head's products as q4q8
        where its target runs q4q8, else as int4 where int4 measures faster than dense here
        (`loading.resolve_quantize`; a draft model is quantized by "auto" only as a target
        would be). A quantized target is another model, and the output is distributed exactly
        as that quantized model's. "int4"
        runs a GGUF target's own Q4_0 / Q4_1 blocks as they are: the file's model, as llama.cpp
        runs it. "q4q8" (CPU, float32 / bfloat16) multiplies by the same 4-bit weights (every
        projection and the output layer) with the activations rounded to int8 per row and
        group of 32 (`treespec.backends.kernels`): products whose cost grows slowly with the
        tree's size, and another model again than int4's. `quantize="auto"` (the default)
        picks "int4" for such a GGUF target where this CPU multiplies int4 faster than dense
        (measured once per machine; with `dtype="auto"` in bf16 where that is faster than the
        auto dtype, as on AVX2-only cores), "q4q8" in its place where the kernels are built
        already (or `compile=True` builds them) and q4q8 multiplies faster than int4, else None:
        the file's weights dequantized into `dtype` (`loading.resolve_weights`). Loading is
        `treespec.loading.load_models`'s.
        `tp`: tensor parallelism, the target split over this many processes launched by torchrun
        (`treespec.parallel`, docs/parallel.md; native backend). None: over every process
        launched (1 without torchrun); 1: each process a whole target. Every rank must make
        the same calls with the same arguments; only rank 0 should print.
        """
        from .backends import check_backend
        from .loading import load_models
        from .planning import load_acceptance

        _check_paths(target, draft)
        DrafterFactory("model" if drafter is None else drafter)  # a bad name fails before anything loads
        check_backend(backend)
        if target is None and draft is None:
            from .zoo import default_pair, pair_draft

            target = default_pair()[0]
            draft = pair_draft(None, "model" if isinstance(drafter, Drafter) else drafter)
        if target is None:
            raise ValueError(
                "pass target= (an HF id, a local model directory or a GGUF file) along with draft="
            )
        loaded = load_models(
            target, draft, dtype, device, backend, draft_dtype, compile, quantize, draft_quantize, tp,
            rank_settings={"drafter": str(drafter)},
        )  # fmt: skip
        drafter = "model" if drafter is None else drafter  # a head drafts as one (see __init__)
        dec = cls(
            loaded.target, loaded.draft, loaded.tokenizer, drafter, draft_tokenizer=loaded.draft_tokenizer
        )
        dec._origin = {**loaded.origin, "drafter": dec.drafter.name}
        dec._shipped_acceptance = load_acceptance(draft) if draft is not None else None
        return dec

    def generate(
        self,
        prompt,
        max_new_tokens: int = 128,
        tree: TreeConfig | None = TreeConfig(),
        sampling: SamplingConfig = SamplingConfig(),
        seed: int | None = None,
        ignore_eos: bool = False,
        on_tokens: OnTokens | None = None,
        rng: Rng | None = None,
        stop=None,
        verification: str | None = None,
        trace: bool = False,
        logprobs: int | None = None,
        constraint=None,
    ) -> GenerationOutput:
        """Generate up to `max_new_tokens` tokens after `prompt`: text, a chat (a list of
        {"role", "content"} messages, rendered with the tokenizer's chat template) or token ids.

        `tree`: the draft tree; `TreeConfig()` (the default) chooses one for this machine and
        drafter (`treespec.planning`; `out.plan` says what and why), `TreeConfig(width, depth,
        ...)` fixes it, and `tree=None` decodes autoregressively with the same runner (the
        in-library baseline).
        The output is distributed exactly as the target's own sampling under `sampling`
        (at temperature 0: exactly its greedy output). `on_tokens(ids, sources)` is called
        with each round's new tokens, for streaming. `rng` replaces the seeded `TorchRng`
        (the exactness tests pass one that enumerates every outcome).

        `stop`: stop strings and/or stop token ids. Generation ends at the token that
        completes a stop string (matched on the decoded generated text, across rounds) or at
        a stop id; that token is kept (Hugging Face's `stop_strings` semantics),
        `finish_reason="stop"`, and `on_tokens` never sees a token past it.

        `verification`: "token", "block" (chains) or "traversal" (siblings drawn without
        replacement or deterministic); None picks the best that applies (`rules()`). A rule
        that does not apply raises ValueError naming those that do (docs/verification.md).

        `trace=True` records every round in `out.trace` (`treespec.trace.RoundTrace`).

        `logprobs=k`: `out.logprobs` (`TokenLogprobs`) holds the target's log-probability of
        every generated token and its k most likely tokens there (0: the token's alone), from
        its raw logits: before temperature, top-k / top-p and penalties.

        `constraint`: the output must match it (docs/structured.md): a
        `treespec.constraints` kind (`JsonSchema`, `JsonObject`, `Regex`, `Choice`, `Grammar`),
        a pydantic model class or a dict such as `{"json_schema": {...}}` or `{"regex": "..."}`.
        The output is then distributed exactly as the target's sampling restricted to what the
        grammar allows (at temperature 0: its greedy output under the grammar); an invalid
        constraint raises ValueError before any work.
        """
        request = make_request(
            prompt,
            self.tokenizer,
            stop=stop,
            max_new_tokens=max_new_tokens,
            tree=tree,
            sampling=sampling,
            seed=seed,
            ignore_eos=ignore_eos,
            on_tokens=on_tokens,
            rng=rng,
            verification=verification,
            trace=trace,
            logprobs=logprobs,
            constraint=constraint,
        )
        with self._exclusive("generate()"):
            engine = self._engine([self.target_runner], [self.draft_runner], release_lanes=False)
            request_id = engine.add(request)
            out = engine.run()[request_id]
        if out.exception is not None:  # one request: its failure is the call's
            raise out.exception
        return out

    def generate_batch(
        self,
        prompts: Sequence,
        max_new_tokens: int | Sequence[int] = 128,
        tree: TreeConfig | None | Sequence[TreeConfig | None] = TreeConfig(),
        sampling: SamplingConfig | Sequence[SamplingConfig] = SamplingConfig(),
        seeds: Sequence[int | None] | None = None,
        ignore_eos: bool = False,
        stop=None,
        verification: str | None | Sequence[str | None] = None,
        max_batch: int = 16,
        trace: bool = False,
        speculate_max_live: int | str | None = None,
        logprobs: int | None = None,
        constraint=None,
    ) -> list[GenerationOutput]:
        """`generate()` for many prompts at once; one output per prompt, in order.

        Each round runs ONE target forward for every live request (their trees packed, each
        request seeing only its own cache row and its own tree) and one draft forward per
        depth. Each output is identical to `generate()` of that prompt alone with the same
        seed and settings. `max_new_tokens`, `tree`, `sampling`, `stop` and `verification`
        take one value for all or a list with one per prompt (`stop`: a list of per-prompt
        stop lists); `seeds` a list. At most `max_batch` requests run at once (the rest wait
        for a free lane). Every request is checked before any runs: a bad one raises
        ValueError naming its index. A request that fails while running (its streaming
        callback, its logits) ends alone: its output has finish_reason "error" and `error`;
        the others finish normally. `speculate_max_live`: see `engine()`. `logprobs`: as
        in `generate()`, for every request. `constraint`: one for all (as in
        `generate()`) or a list with one (or None) per prompt; each request has its own grammar
        state.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError(
                "generate_batch() takes a list of prompts (text or token id lists); use generate() for one"
            )
        n = len(prompts)
        if n == 0:
            raise ValueError("generate_batch() got an empty list of prompts")
        check_positive_int("max_batch", max_batch)
        if seeds is not None and (isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence)):
            raise ValueError(
                f"seeds must be a list with one seed (or None) per prompt, got {type(seeds).__name__}"
            )
        listed = (
            _listed(stop) and bool(stop) and all(v is None or _listed(v) for v in stop)
        )  # a list of stop lists
        per_request = {
            "max_new_tokens": _per_request("max_new_tokens", max_new_tokens, n, _listed(max_new_tokens)),
            "tree": _per_request("tree", tree, n, _listed(tree)),
            "sampling": _per_request("sampling", sampling, n, _listed(sampling)),
            "verification": _per_request("verification", verification, n, _listed(verification)),
            "stop": _per_request("stop", stop, n, listed),
            "seed": _per_request("seeds", seeds, n, seeds is not None),
            "constraint": _per_request("constraint", constraint, n, isinstance(constraint, (list, tuple))),
        }
        with self._exclusive("generate_batch()"):
            engine = self._engine(
                *self._lanes(min(n, max_batch)), speculate_max_live=speculate_max_live, release_lanes=False
            )
            ids = []
            for i, prompt in enumerate(prompts):  # every request checked before any runs
                try:
                    settings = {k: v[i] for k, v in per_request.items()}
                    ids.append(
                        engine.add(prompt, ignore_eos=ignore_eos, trace=trace, logprobs=logprobs, **settings)
                    )
                except ValueError as e:
                    raise ValueError(f"request {i}: {e}") from None
            outputs = engine.run()
        return [outputs[i] for i in ids]

    def engine(
        self,
        max_live: int = 8,
        max_kv_tokens: int | None = None,
        speculate_max_live: int | str | None = None,
        deterministic: bool = False,
        shared_tree_nodes: int | None = None,
        round_tokens: int | None = DEFAULT_ROUND_TOKENS,
    ) -> Engine:
        """A continuous-batching `Engine` over `max_live` new lanes of this decoder's models (its
        own: no other engine and no `generate()` touches them): add requests, `step()` rounds,
        stream, `cancel()`. `max_kv_tokens` caps the cache slots live requests reserve together.

        `speculate_max_live`: with more live requests than this, a round drafts nothing and
        every request decodes one token plainly (vLLM's speculative_disable_by_batch_size).
        Every round is exact either way, but a request that switched mode is no longer
        token-identical to `generate()` alone (its draws are consumed differently). "auto":
        each round speculates or not by which has measured more tokens per second at about
        this many live requests (`treespec.planning.GoodputSwitch`, one per decoder, so what
        its engines measured carries over). None (default): always speculate.

        `deterministic=True`: a request's output depends only on itself (prompt, settings,
        seed), never on what else the engine runs: each lane forwards alone, with the numbers
        of `generate()` (batch-invariant; vLLM's idea), at the cost of batching's speed-up. It
        excludes `speculate_max_live`, whose choice depends on the load. A sampled request with
        `TreeConfig(plain_fallback=True)` opts out for itself: its rounds follow measured timings.

        `shared_tree_nodes`: in a round with other requests, a request whose tree holds more
        nodes than this decodes plainly (a server's fairness: a large tree slows every other
        request's round, docs/serving.md). Exact, like
        `speculate_max_live`, and like it excluded by `deterministic`; requests within the cap
        are untouched. None (default): no cap.

        `round_tokens`: the prompt tokens one step prefills (with the round's tree nodes): long
        prompts load in pieces while live requests keep decoding (`treespec.prefill`; None:
        whole prompts in the step that admits them). A finished request's lanes give back their
        cache memory."""
        check_positive_int("max_live", max_live)
        check_int_at_least("shared_tree_nodes", shared_tree_nodes, 0, none_ok=True)
        if deterministic and shared_tree_nodes is not None:
            raise ValueError(
                "deterministic=True needs shared_tree_nodes=None: trimming trees by load would make "
                "outputs depend on the load"
            )
        if deterministic and speculate_max_live is not None:
            raise ValueError(
                "deterministic=True needs speculate_max_live=None: switching speculation by load "
                "would make outputs depend on the load"
            )
        runners = [r for r in (self.target_runner, self.draft_runner) if r is not None]
        if deterministic and not all(r.lanes_match_solo for r in runners):
            raise ValueError(
                "deterministic=True needs lanes that compute as generate() does, and a compiled native "
                "runner compiles its one-lane forward only: load the models with compile=False"
            )
        targets = self.target_runner.lanes(max_live)
        drafts = [None] * max_live if self.draft_runner is None else self.draft_runner.lanes(max_live)
        for lane in targets + drafts:
            if lane is not None:
                lane.batch_invariant = bool(deterministic)
        return self._engine(
            targets, drafts, max_kv_tokens, speculate_max_live, shared_tree_nodes, round_tokens
        )

    @property
    def planner(self) -> Planner:
        """The `treespec.planning.Planner` of this decoder's automatic trees (`TreeConfig()`):
        its costs are measured (or read from the cache) at the first automatic request."""
        if self._planner is None:
            self._planner = planner_for(self._measure_costs, self._origin, self._shipped_acceptance)
        return self._planner

    @planner.setter
    def planner(self, planner: Planner) -> None:
        """Plan this decoder's automatic trees with `planner` (e.g. a `Planner` of known costs
        and acceptance) instead of measuring this machine's costs; engines made before keep
        the one they were given."""
        self._planner = planner

    def _measure_costs(self) -> Costs:
        """This machine's costs for this decoder's models (`treespec.planning.measure_costs`):
        short generations on an engine of one lane of its own, where a draft model drafts."""
        drafts = self.drafter.needs_draft_model and self.draft_runner is not None
        engine = (lambda: self.engine(max_live=1)) if drafts else None
        return measure_costs(self.target_runner, self.draft_runner, engine)

    def rules(self, tree: TreeConfig | None) -> tuple[str, ...]:
        """The verification rules that apply to `tree` with this decoder's drafter, worst to
        best (`treespec.rules.rules_for`; docs/verification.md says why)."""
        return rules_for(self.drafter.siblings(tree))

    # ---- helpers ---------------------------------------------------------------------------
    def _engine(
        self,
        targets,
        drafts,
        max_kv_tokens=None,
        speculate_max_live=None,
        shared_tree_nodes=None,
        round_tokens=DEFAULT_ROUND_TOKENS,
        release_lanes=True,
    ) -> Engine:
        check_positive_int("max_kv_tokens", max_kv_tokens, none_ok=True)
        if speculate_max_live != "auto" and speculate_max_live is not None:
            if (
                not isinstance(speculate_max_live, int)
                or isinstance(speculate_max_live, bool)
                or speculate_max_live < 1
            ):
                raise ValueError(
                    f"speculate_max_live must be None, an integer >= 1 or 'auto', got {speculate_max_live!r}"
                )
        if self.drafter.custom and len(targets) > 1:
            raise ValueError(
                "a Drafter instance holds one sequence's state, so it cannot serve several requests at once; "
                "batch with a named drafter ('model', 'ngram', 'lookup', 'merged') or use max_live=1"
            )
        switch = None
        if speculate_max_live == "auto":
            switch = self._goodput = self._goodput or GoodputSwitch()
            speculate_max_live = None
        return Engine(
            targets,
            drafts,
            self.drafter,
            self.tokenizer,
            self.eos_token_ids,
            max_kv_tokens,
            speculate_max_live,
            switch,
            self.planner,
            shared_tree_nodes,
            round_tokens,
            release_lanes,
        )

    @contextmanager
    def _exclusive(self, what: str):
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"{what}: this SpeculativeDecoder is already generating (in another thread, or "
                "from a streaming "
                f"callback); a decoder runs one generate() at a time: use one decoder per thread, or one "
                f"engine() stepped by one thread"
            )
        try:
            yield
        finally:
            self._busy.release()

    def _lanes(self, n: int) -> tuple[list[Runner], list[Runner | None]]:
        """`n` target and draft lanes for generate_batch() (kept for the next batch of the same
        size; only ever used under `_exclusive`)."""
        if n == 1:
            return [self.target_runner], [self.draft_runner]
        if self._batch_lanes is None or self._batch_lanes[0] != n:
            drafts = [None] * n if self.draft_runner is None else self.draft_runner.lanes(n)
            self._batch_lanes = (n, self.target_runner.lanes(n), drafts)
        return self._batch_lanes[1], self._batch_lanes[2]


def _listed(value) -> bool:
    return isinstance(value, (list, tuple))


def _per_request(name: str, value, n: int, per_request: bool) -> list:
    """`value` for each of n requests: the list itself when `per_request`, else one value for all."""
    if not per_request:
        return [value] * n
    if len(value) != n:
        raise ValueError(
            f"{name} has {len(value)} entries for {n} prompts; give one per prompt or a single value for all"
        )
    return list(value)


def _check_paths(target, draft) -> None:
    for name, path in (("target", target), ("draft", draft)):
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ValueError(
                f"from_pretrained() takes paths or hub ids, got a {type(path).__name__} for {name}; "
                f"pass loaded models to SpeculativeDecoder(target, draft, tokenizer) instead"
            )
