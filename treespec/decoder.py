"""The user-facing decoder: load models, check every input, pick drafters and rules.

`SpeculativeDecoder` turns what a user passes (paths or models, prompts, `TreeConfig`,
`SamplingConfig`, stops, seeds) into checked `Request`s and hands them to the decode loop in
`treespec.engine`: `generate()` runs one request, `generate_batch()` many at once and
`engine()` gives the continuous-batching loop itself. Bad input raises ValueError here,
before any forward runs. Models run behind `treespec.backends` (no transformers import here).
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from .adaptive import GoodputSwitch
from .backends import Runner, auto_dtype, check_backend, make_runner, use_native
from .config import SamplingConfig, TreeConfig
from .drafters import Drafter, MergedDrafter, ModelDrafter, NgramDrafter, PromptLookupDrafter
from .engine import Engine, Request
from .proposal import DraftTree
from .rng import Rng, TorchRng
from .stats import GenerationOutput, OnTokens, OutputBuilder, StopMatcher
from .verify import RULES
from .vocab import compare_tokenizers, shared_support


DRAFTERS = ("model", "ngram", "lookup", "merged")


def _check_drafter(drafter) -> None:
    if not isinstance(drafter, Drafter) and drafter not in DRAFTERS:
        raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)} or a Drafter, got {drafter!r}")


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
      a `Drafter` instance: used as it is; `TreeConfig.depth` still caps each round's depth

    `backend` runs HF models: "native" (treespec's static-cache Llama forward), "hf" (the
    model's own modules over a DynamicCache) or "auto": native where the architecture is
    supported, else hf with a one-line notice. Runners are used as given.
    """

    DRAFTERS = DRAFTERS  # the drafter names SpeculativeDecoder(drafter=...) takes

    def __init__(
        self, target, draft=None, tokenizer=None, drafter: str | Drafter = "model", backend: str = "auto", draft_tokenizer=None
    ):
        _check_drafter(drafter)
        if target is None:
            raise ValueError("target is None; pass a Hugging Face causal LM or a treespec Runner")
        for name, model in (("target", target), ("draft", draft)):
            if isinstance(model, (str, os.PathLike)):
                raise ValueError(
                    f"{name} is a path ({str(model)!r}), not a model; SpeculativeDecoder() takes loaded models: "
                    f"use SpeculativeDecoder.from_pretrained(target=..., draft=...) to load from paths or hub ids"
                )
        if isinstance(tokenizer, (str, os.PathLike)):
            raise ValueError(
                f"tokenizer is a path ({str(tokenizer)!r}); pass a loaded tokenizer "
                f"(transformers.AutoTokenizer.from_pretrained(path)) or use SpeculativeDecoder.from_pretrained"
            )
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(
                f"tokenizer must be a Hugging Face tokenizer (callable, with decode()), got {type(tokenizer).__name__}"
            )
        self.drafter, self.tokenizer = drafter, tokenizer
        self.target_runner: Runner = make_runner(target, backend)
        self.draft_runner: Runner | None = None if draft is None else make_runner(draft, backend)
        self.vocab_size = self.target_runner.vocab_size  # q is a distribution over the target's rows
        compare_tokenizers(tokenizer, draft_tokenizer)
        # ids q may put mass on: the real tokens both models know (padding rows excluded)
        self.draft_support = (
            None if self.draft_runner is None
            else shared_support(self.vocab_size, self.draft_runner.vocab_size, tokenizer if tokenizer is not None else draft_tokenizer)
        )
        self.eos_token_ids = set(self.target_runner.eos_token_ids)
        self._lane_cache: tuple[int, list[Runner], list[Runner | None]] | None = None  # see _lanes()
        self._goodput: GoodputSwitch | None = None  # speculate_max_live="auto", kept across engines

    @classmethod
    def from_pretrained(
        cls,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        dtype: torch.dtype | str = "auto",
        device: torch.device | str | None = None,
        backend: str = "auto",
        drafter: str | Drafter = "model",
        draft_dtype: torch.dtype | str | None = None,
    ) -> SpeculativeDecoder:
        """Load target, draft and the target's tokenizer from local directories or HF ids.

        With no arguments, loads the bundled pair (see `treespec.zoo`). `dtype="auto"` is
        bf16 on CUDA; on a CPU, bf16 for the target where the CPU has AMX or AVX512-BF16 and
        fp32 for the draft (`treespec.backends.auto_dtype` has the measurements).
        `draft_dtype` overrides the draft's (default: `dtype`). `device` defaults to the CPU.
        `backend="native"` (or "auto" on a supported checkpoint) reads the weights straight
        from safetensors without building the HF model.
        """
        from .backends import hf

        for name, path in (("target", target), ("draft", draft)):
            if path is not None and not isinstance(path, (str, os.PathLike)):
                raise ValueError(
                    f"from_pretrained() takes paths or hub ids, got a {type(path).__name__} for {name}; "
                    f"pass loaded models to SpeculativeDecoder(target, draft, tokenizer) instead"
                )
        _check_drafter(drafter)
        if target is None and draft is None:
            from .zoo import default_pair

            target, draft = default_pair()
        if target is None:
            raise ValueError("pass target= (an HF id or a local model directory) along with draft=")
        check_backend(backend)
        device = resolve_device(device)
        dtypes = (_resolve_dtype(dtype, device, "target"), _resolve_dtype(dtype if draft_dtype is None else draft_dtype, device, "draft"))
        runners = [None if p is None else _load_runner(p, t, device, backend) for p, t in zip((target, draft), dtypes)]
        draft_tokenizer = None if draft is None else hf.load_tokenizer(draft)
        return cls(runners[0], runners[1], hf.load_tokenizer(target), drafter=drafter, draft_tokenizer=draft_tokenizer)

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        tree: TreeConfig | None = TreeConfig(),
        sampling: SamplingConfig = SamplingConfig(),
        seed: int | None = None,
        ignore_eos: bool = False,
        on_tokens: OnTokens | None = None,
        rng: Rng | None = None,
        stop: str | int | Sequence[str | int] | None = None,
        verification: str | None = None,
        trace: bool = False,
    ) -> GenerationOutput:
        """Generate up to `max_new_tokens` tokens after `prompt` (text or token ids).

        `tree=None` decodes autoregressively with the same runner (the in-library baseline).
        The output is distributed exactly as the target's own sampling under `sampling`
        (at temperature 0: exactly its greedy output). `on_tokens(ids, sources)` is called
        with each round's new tokens, for streaming. `rng` replaces the seeded `TorchRng`
        (the exactness tests pass one that enumerates every outcome).

        `stop`: stop strings and/or stop token ids. Generation ends at the token that
        completes a stop string (matched on the decoded generated text, across rounds) or at
        a stop id; that token is kept (Hugging Face's `stop_strings` semantics: the text may
        run past the stop string by the rest of that token), `finish_reason="stop"`, and
        `on_tokens` never sees a token past it.

        `verification` is the rule that checks the draft (all lossless, see `treespec.verify`):
        "token" (token by token from the root), "block" (chains: Sun et al. 2025) or
        "traversal" (trees with siblings drawn without replacement or deterministic: Weng et
        al. 2025). None picks the best that applies: block on chains, traversal on
        without-replacement / Sequoia / top-k / dynamic / n-gram / lookup trees, token on
        i.i.d. and merged trees (and for custom drafters).
        A rule that does not apply raises ValueError naming those that do.

        `trace=True` records every round in `out.trace` (a list of `treespec.trace.RoundTrace`:
        the draft tree, each proposal's p, q, coin and outcome, the final token and its source,
        the depth decision); `treespec.trace.render_round` / `plot_round` draw one.
        """
        engine = Engine(self, [self.target_runner], [self.draft_runner])
        request = engine.add(
            prompt, max_new_tokens=max_new_tokens, tree=tree, sampling=sampling, seed=seed, ignore_eos=ignore_eos,
            on_tokens=on_tokens, rng=rng, stop=stop, verification=verification, trace=trace,
        )
        return engine.run()[request]

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[int]],
        max_new_tokens: int | Sequence[int] = 128,
        tree: TreeConfig | None | Sequence[TreeConfig | None] = TreeConfig(),
        sampling: SamplingConfig | Sequence[SamplingConfig] = SamplingConfig(),
        seeds: Sequence[int | None] | None = None,
        ignore_eos: bool = False,
        stop: str | int | Sequence[str | int] | None | list = None,
        verification: str | None | Sequence[str | None] = None,
        max_batch: int = 16,
        trace: bool = False,
        speculate_max_live: int | str | None = None,
    ) -> list[GenerationOutput]:
        """`generate()` for many prompts at once; one output per prompt, in order.

        Each round runs ONE target forward for every live request (their trees packed, each
        request seeing only its own cache row and its own tree) and one draft forward per
        depth, on the native backend; the HF backend runs the same loop with a forward per
        request. Each output is identical to `generate()` of that prompt alone with the same
        seed and settings. `max_new_tokens`, `tree`, `sampling`, `stop` and `verification`
        take one value for all or a list with one per prompt (`stop`: a list of per-prompt
        stop lists); `seeds` a list. Requests finish independently; at most `max_batch` run
        at once (the rest wait for a free lane). `trace=True` records every request's rounds
        (`out.trace`, as in `generate()`). Every request is checked before any runs: a bad one
        raises ValueError naming its index. `speculate_max_live`: see `engine()`.
        """
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise ValueError("generate_batch() takes a list of prompts (text or token id lists); use generate() for one")
        n = len(prompts)
        if n == 0:
            raise ValueError("generate_batch() got an empty list of prompts")
        if seeds is not None and (isinstance(seeds, (str, bytes)) or not isinstance(seeds, Sequence)):
            raise ValueError(f"seeds must be a list with one seed (or None) per prompt, got {type(seeds).__name__}")
        per_request = {
            "max_new_tokens": _per_request("max_new_tokens", max_new_tokens, n, _listed(max_new_tokens)),
            "tree": _per_request("tree", tree, n, _listed(tree)),
            "sampling": _per_request("sampling", sampling, n, _listed(sampling)),
            "verification": _per_request("verification", verification, n, _listed(verification)),
            # a list of stop lists (or None) is per request; a list of strings / ids is for all
            "stop": _per_request("stop", stop, n, _listed(stop) and bool(stop) and all(v is None or _listed(v) for v in stop)),
            "seed": _per_request("seeds", seeds, n, seeds is not None),
        }
        engine = self.engine(max_live=min(n, max_batch), speculate_max_live=speculate_max_live)
        requests = []
        for i, prompt in enumerate(prompts):  # every request checked (built) before any runs
            try:
                requests.append(self._request(i, prompt, ignore_eos=ignore_eos, trace=trace, **{k: v[i] for k, v in per_request.items()}))
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
        ids = [engine._submit(r) for r in requests]
        outputs = engine.run()
        return [outputs[i] for i in ids]

    def engine(self, max_live: int = 8, max_kv_tokens: int | None = None, speculate_max_live: int | str | None = None) -> Engine:
        """A continuous-batching `Engine` over `max_live` lanes of this decoder's models: add
        requests (`generate()`'s arguments), `step()` rounds, stream, `cancel()`. `max_kv_tokens`
        caps the cache slots live requests reserve together (None: no cap beyond the lanes).

        `speculate_max_live`: with more live requests than this, a round drafts nothing and
        every request decodes one token plainly (vLLM's speculative_disable_by_batch_size):
        where the batched target forward is compute-bound, speculation's extra tokens cost
        about their full price (README, "Batched decoding"). Every round is exact either way,
        so outputs keep the target's distribution, but a request that switched mode is no
        longer token-identical to `generate()` alone (its draws are consumed differently).
        "auto": no fixed limit; each round speculates or not by which has measured more tokens
        per second at about this many live requests (`treespec.adaptive.GoodputSwitch`; one
        per decoder, so what its engines measured carries over to the next).
        None (default): always speculate."""
        if not isinstance(max_live, int) or isinstance(max_live, bool) or max_live < 1:
            raise ValueError(f"max_live must be an integer >= 1, got {max_live!r}")
        if max_kv_tokens is not None and (not isinstance(max_kv_tokens, int) or isinstance(max_kv_tokens, bool) or max_kv_tokens < 1):
            raise ValueError(f"max_kv_tokens must be None or an integer >= 1, got {max_kv_tokens!r}")
        if isinstance(self.drafter, Drafter) and max_live > 1:
            raise ValueError(
                "a Drafter instance holds one sequence's state, so it cannot serve several requests at once; "
                "batch with a named drafter ('model', 'ngram', 'lookup', 'merged') or use max_live=1"
            )
        if speculate_max_live not in (None, "auto") and (
            not isinstance(speculate_max_live, int) or isinstance(speculate_max_live, bool) or speculate_max_live < 1
        ):
            raise ValueError(f"speculate_max_live must be None, an integer >= 1 or 'auto', got {speculate_max_live!r}")
        targets, drafts = self._lanes(max_live)
        if speculate_max_live != "auto":
            return Engine(self, targets, drafts, max_kv_tokens, speculate_max_live)
        if self._goodput is None:
            self._goodput = GoodputSwitch()
        return Engine(self, targets, drafts, max_kv_tokens, switch=self._goodput)

    def _lanes(self, n: int) -> tuple[list[Runner], list[Runner | None]]:
        """`n` target lanes and `n` draft lanes (kept for the next batch of the same size)."""
        if n == 1:
            return [self.target_runner], [self.draft_runner]
        if self._lane_cache is None or self._lane_cache[0] != n:
            drafts = [None] * n if self.draft_runner is None else self.draft_runner.lanes(n)
            self._lane_cache = (n, self.target_runner.lanes(n), drafts)
        return self._lane_cache[1], self._lane_cache[2]

    def _request(
        self,
        request_id: int,
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
    ) -> Request:
        """A checked `Request` (ValueError for bad input; nothing runs)."""
        ids = self._check(prompt, max_new_tokens, tree, sampling)
        _check_seed(seed)
        stopper = self._stop_matcher(stop)
        if on_tokens is not None and not callable(on_tokens):
            raise ValueError(f"on_tokens must be a function (ids, sources) -> None, got {type(on_tokens).__name__}")
        if rng is not None and not isinstance(rng, Rng):
            raise ValueError(f"rng must be a treespec.rng.Rng, got {type(rng).__name__}; pass seed= for a seeded run")
        rule = self._rule(tree, verification)
        if not isinstance(trace, bool):
            raise ValueError(f"trace must be True or False, got {trace!r}")
        if tree is not None and not isinstance(self.drafter, Drafter) and self.drafter in ("model", "merged") and self.draft_runner is None:
            raise ValueError(
                f"drafter={self.drafter!r} needs a draft model; pass draft=..., use drafter='ngram' or "
                f"'lookup', or tree=None for plain decoding"
            )
        out = OutputBuilder(max_new_tokens, set() if ignore_eos else self.eos_token_ids, on_tokens, stopper)
        rng = TorchRng(seed, self.target_runner.device) if rng is None else rng
        slots = len(ids) + max_new_tokens + (0 if tree is None else tree.max_depth)
        return Request(request_id, ids, tree, sampling, rule, rng, out, slots, trace=[] if trace else None)

    # ---- helpers ---------------------------------------------------------------------------
    def _drafter(self, tree: TreeConfig, draft_runner: Runner | None = None) -> Drafter:
        """The drafter of one request, drafting with `draft_runner` (its lane of the draft model;
        default: the decoder's own draft runner)."""
        draft_runner = self.draft_runner if draft_runner is None else draft_runner
        if isinstance(self.drafter, Drafter):
            return self.drafter
        if self.drafter == "ngram":
            return NgramDrafter(tree.width)
        if self.drafter == "lookup":
            return PromptLookupDrafter(tree.width)
        model = ModelDrafter(draft_runner, tree, vocab_size=self.vocab_size, support=self.draft_support)
        return model if self.drafter == "model" else MergedDrafter([model, NgramDrafter(tree.width)])

    def _check_draft(self, draft: DraftTree, context: list[int], drafter: Drafter) -> None:
        """A drafter's tree must fit the target: rooted at the last committed token, token ids
        and q inside the target's vocabulary (custom drafters are checked like built-in ones)."""
        name, tokens, V = type(drafter).__name__, draft.tree.tokens, self.vocab_size
        if tokens[0] != context[-1]:
            raise ValueError(f"{name} proposed a tree rooted at token {tokens[0]}, not at the last committed token {context[-1]}")
        if max(tokens) >= V:
            bad = sorted({t for t in tokens if t >= V})
            raise ValueError(f"{name} proposed token ids {bad[:5]} outside the target's vocabulary [0, {V})")
        for g in draft.groups:
            if g.q is not None and g.q.shape[-1] != V:
                raise ValueError(
                    f"{name} proposed from a q over {g.q.shape[-1]} tokens, but the target's vocabulary has {V}; "
                    f"give q one entry per target token id"
                )

    def _stop_matcher(self, stop) -> StopMatcher | None:
        if stop is None:
            return None
        if isinstance(stop, (bytes, bytearray, memoryview)):
            raise ValueError("stop is bytes; pass stop strings as str (or token ids as ints)")
        items = [stop] if isinstance(stop, (str, numbers.Integral)) else stop
        try:
            items = list(items)
        except TypeError:
            raise ValueError(f"stop must be a string, a token id or a list of them, got {type(stop).__name__}") from None
        strings, ids = [], set()
        for x in items:
            if isinstance(x, str):
                if not x:
                    raise ValueError("stop strings must not be empty")
                strings.append(x)
            elif isinstance(x, numbers.Integral) and not isinstance(x, bool):
                if not 0 <= x < self.target_runner.vocab_size:
                    raise ValueError(f"stop token id {x} is outside the vocabulary [0, {self.target_runner.vocab_size})")
                ids.add(int(x))
            else:
                raise ValueError(f"stop entries must be strings or int token ids, got {x!r} ({type(x).__name__})")
        if strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer to decode the output; pass tokenizer=... or stop token ids")
        return StopMatcher(strings, ids, self.tokenizer) if strings or ids else None

    def rules(self, tree: TreeConfig | None) -> tuple[str, ...]:
        """The verification rules that apply to `tree` with this decoder's drafter, worst to best.

        block needs a chain: width 1 (a Sequoia shape: a chain shape). traversal needs every
        node's proposals to be distinct children, drawn without replacement or deterministic
        (or a single proposal); which nodes grow may depend on any draw, but no drawn proposal
        may be dropped: chains, "without_replacement" (stochastic beam), "sequoia", "topk",
        "dynamic", n-gram and prompt-lookup trees. Not: i.i.d. trees (duplicate draws share one
        node, so one subtree would be tested twice) and merged drafters (two drafters' proposals
        share nodes). A custom `Drafter` gets "token" by default; ask for another rule only if
        its trees meet these conditions (each round's structure is checked, the rest is not).
        """
        if tree is None or isinstance(self.drafter, Drafter):
            return RULES
        if self.drafter == "merged":
            return ("token",)
        chain_rules = ("token", "traversal", "block")  # equal on a chain; block is the vectorised form
        if self.drafter in ("ngram", "lookup"):
            return chain_rules if tree.width == 1 else ("token", "traversal")
        chain = all(len(c) <= 1 for c in tree.shape.children()) if tree.strategy == "sequoia" else tree.width == 1
        if chain:
            return chain_rules
        return ("token",) if tree.strategy == "iid" else ("token", "traversal")

    def _rule(self, tree: TreeConfig | None, verification: str | None) -> str:
        if verification is None:
            return "token" if tree is None or isinstance(self.drafter, Drafter) else self.rules(tree)[-1]
        if verification not in RULES:
            raise ValueError(f"verification must be one of {', '.join(RULES)} or None (the best that applies), got {verification!r}")
        fits = self.rules(tree)
        if verification not in fits:
            what = f"drafter={self.drafter!r}" if self.drafter == "merged" else f"strategy={tree.strategy!r}, width={tree.width}"
            raise ValueError(
                f"verification={verification!r} does not apply to {what}: block needs a chain (width 1), traversal "
                f"needs siblings drawn without replacement or deterministically (not strategy 'iid' with width > 1, "
                f"not drafter 'merged'); here {' or '.join(repr(r) for r in fits)} applies"
            )
        return verification

    def _check(self, prompt, max_new_tokens, tree, sampling) -> list[int]:
        if not isinstance(sampling, SamplingConfig):
            raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        if tree is not None and not isinstance(tree, TreeConfig):
            raise ValueError(f"tree must be a TreeConfig or None, got {type(tree).__name__}")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass tokenizer=... or a list of token ids")
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = _token_ids(prompt)
        if not ids or (isinstance(prompt, str) and not prompt):
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.target_runner.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.target_runner.vocab_size})")
        # the draft model's positions matter only to drafters that run it
        uses_draft = tree is not None and not isinstance(self.drafter, Drafter) and self.drafter in ("model", "merged")
        for name, run in (("target", self.target_runner), ("draft", self.draft_runner if uses_draft else None)):
            limit = getattr(run, "max_positions", None)
            if limit is not None and len(ids) + max_new_tokens > limit:
                raise ValueError(
                    f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the {name} "
                    f"model's {limit} positions; shorten the prompt or lower max_new_tokens"
                )
        return ids


def _token_ids(prompt) -> list[int]:
    """A prompt given as token ids, as a list of Python ints; anything else is refused, never
    converted (bytes, floats, bools and strings are mistakes, not token ids)."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise ValueError("the prompt is bytes; pass text (str) or a list of int token ids")
    if isinstance(prompt, torch.Tensor) or hasattr(prompt, "dtype"):  # a torch or numpy array
        shape, dtype = tuple(prompt.shape), str(prompt.dtype)
        if len(shape) != 1:
            raise ValueError(f"a prompt tensor must be 1-D token ids, got shape {shape}; pass input_ids[0]")
        integer = (not prompt.dtype.is_floating_point and not prompt.dtype.is_complex and prompt.dtype != torch.bool
                   if isinstance(prompt, torch.Tensor) else getattr(prompt.dtype, "kind", "") in ("i", "u"))
        if not integer:
            raise ValueError(f"prompt token ids must be integers, got an array of {dtype}")
        return [int(t) for t in prompt.tolist()]
    try:
        items = list(prompt)
    except TypeError:
        raise ValueError(f"the prompt must be text or a list of int token ids, got {type(prompt).__name__}") from None
    for t in items:
        if not isinstance(t, numbers.Integral) or isinstance(t, bool):
            raise ValueError(
                f"prompt token ids must be ints, got {t!r} ({type(t).__name__}); pass ints "
                f"(not floats, bools or strings), or the prompt as text"
            )
    return [int(t) for t in items]


def _listed(value) -> bool:
    return isinstance(value, (list, tuple))


def _per_request(name: str, value, n: int, per_request: bool) -> list:
    """`value` for each of n requests: the list itself when `per_request`, else one value for all."""
    if not per_request:
        return [value] * n
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries for {n} prompts; give one per prompt or a single value for all")
    return list(value)


def _check_seed(seed) -> None:
    if seed is None:
        return
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be None or an integer in [0, 2**64), got {seed!r}")


def resolve_device(device) -> torch.device:
    """`device` (None = CPU) as a torch.device that exists on this machine, or a ValueError
    saying which devices do."""
    if device is None:
        return torch.device("cpu")
    if not isinstance(device, (str, torch.device)) and not (isinstance(device, int) and not isinstance(device, bool)):
        raise ValueError(f"device must be a string like 'cpu' or 'cuda:0', got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"unknown device {device!r}; use 'cpu', 'cuda' or 'cuda:N' (or 'mps' on a Mac)") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "meta":
        raise ValueError("device 'meta' holds no weights; use 'cpu' or 'cuda'")
    backend = getattr(torch, dev.type, None) if dev.type != "mps" else getattr(torch.backends, "mps", None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise ValueError(f"device {device!r} is not available on this machine (torch {torch.__version__}); use device='cpu'")
    count = getattr(backend, "device_count", None)
    n = count() if count is not None else 1
    if dev.index is not None and dev.index >= n:
        raise ValueError(f"device {device!r} is not available: this machine has {n} {dev.type} device(s), {dev.type}:0 .. {dev.type}:{n - 1}")
    return dev


def _resolve_dtype(dtype, device: torch.device, role: str = "target") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype(device, role)
    if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use 'auto', 'float32' or 'bfloat16'")
    return getattr(torch, dtype)


def _load_runner(path, dtype: torch.dtype, device: torch.device, backend: str) -> Runner:
    """A runner for the checkpoint at `path`: native straight from safetensors when the
    backend allows it and the directory holds a supported checkpoint, else through HF."""
    from .backends import hf

    local = hf.resolve_path(path)
    if backend != "hf" and isinstance(local, Path):
        from .backends.native import NativeRunner, read_json, unsupported_reason

        if use_native(backend, unsupported_reason(read_json(local / "config.json")), repr(str(path))):
            return NativeRunner.from_pretrained(local, dtype=dtype, device=device)
        backend = "hf"  # the fallback notice has been printed
    return make_runner(hf.load_model(local, dtype, device), backend)
