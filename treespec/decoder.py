"""The decode loop: propose, score, verify, commit.

    prefill(prompt)                           target cache holds all but the last committed token
    while not done:
        draft = drafter.propose(context)      DraftTree rooted at the last committed token
        logits = target.score(draft.tree)     ONE target forward over every node (tree mask)
        walk = verify(draft, logits)          accepted path + one correction/bonus token
        target.commit(walk.path)              keep the accepted nodes' cache, drop the rest

Models run behind `treespec.backends`: the decoder sees `Runner`s only (no transformers
import here). Statistics live in `GenerationStats.record_round`, token emission (length
limit, EOS, streaming) in `OutputBuilder`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .backends import BACKENDS, Runner, auto_dtype, make_runner
from .config import SamplingConfig, TreeConfig
from .drafters import Drafter, MergedDrafter, ModelDrafter, NgramDrafter, PromptLookupDrafter
from .proposal import DraftTree
from .rng import Rng, TorchRng
from .stats import GenerationOutput, GenerationStats, OnTokens, OutputBuilder
from .verify import RULES, verify


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

    DRAFTERS = ("model", "ngram", "lookup", "merged")

    def __init__(self, target, draft=None, tokenizer=None, drafter: str | Drafter = "model", backend: str = "auto"):
        if not isinstance(drafter, Drafter) and drafter not in self.DRAFTERS:
            raise ValueError(f"drafter must be one of {', '.join(self.DRAFTERS)} or a Drafter, got {drafter!r}")
        if target is None:
            raise ValueError("target is None; pass a Hugging Face causal LM or a treespec Runner")
        self.drafter, self.tokenizer = drafter, tokenizer
        self.target_runner: Runner = make_runner(target, backend)
        self.draft_runner: Runner | None = None if draft is None else make_runner(draft, backend)
        if self.draft_runner is not None and self.draft_runner.vocab_size != self.target_runner.vocab_size:
            raise ValueError(
                f"draft and target vocabularies differ ({self.draft_runner.vocab_size} vs "
                f"{self.target_runner.vocab_size} tokens); speculative decoding needs one shared tokenizer"
            )
        self.eos_token_ids = set(self.target_runner.eos_token_ids)

    @classmethod
    def from_pretrained(
        cls,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        dtype: torch.dtype | str = "auto",
        device: torch.device | str | None = None,
        backend: str = "auto",
        drafter: str | Drafter = "model",
    ) -> SpeculativeDecoder:
        """Load target, draft and the target's tokenizer from local directories or HF ids.

        With no arguments, loads the bundled pair (see `treespec.zoo`). `dtype="auto"` is
        bf16 on CUDA or on a CPU with AMX, else fp32; `device` defaults to the CPU.
        `backend="native"` (or "auto" on a supported checkpoint) reads the weights straight
        from safetensors without building the HF model.
        """
        from .backends import hf

        if target is None and draft is None:
            from .zoo import default_pair

            target, draft = default_pair()
        if target is None:
            raise ValueError("pass target= (an HF id or a local model directory) along with draft=")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        device = torch.device("cpu" if device is None else device)
        dtype = _resolve_dtype(dtype, device)
        runners = [None if p is None else _load_runner(p, dtype, device, backend) for p in (target, draft)]
        return cls(runners[0], runners[1], hf.load_tokenizer(target), drafter=drafter)

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
        verification: str | None = None,
    ) -> GenerationOutput:
        """Generate up to `max_new_tokens` tokens after `prompt` (text or token ids).

        `tree=None` decodes autoregressively with the same runner (the in-library baseline).
        The output is distributed exactly as the target's own sampling under `sampling`
        (at temperature 0: exactly its greedy output). `on_tokens(ids, sources)` is called
        with each round's new tokens, for streaming. `rng` replaces the seeded `TorchRng`
        (the exactness tests pass one that enumerates every outcome).

        `verification` is the rule that checks the draft (all lossless, see `treespec.verify`):
        "token" (token by token from the root), "block" (chains: Sun et al. 2025) or
        "traversal" (trees with siblings drawn without replacement or deterministic: Weng et
        al. 2025). None picks the best that applies: block on chains, traversal on
        without-replacement / Sequoia / top-k / dynamic / n-gram / lookup trees, token on
        i.i.d. and merged trees (and for custom drafters).
        A rule that does not apply raises ValueError naming those that do.
        """
        ids = self._check(prompt, max_new_tokens, tree, sampling)
        rule = self._rule(tree, verification)
        clock = time.perf_counter
        t_start = clock()
        stats, out = GenerationStats(), OutputBuilder(max_new_tokens, set() if ignore_eos else self.eos_token_ids, on_tokens)
        rng = TorchRng(seed, self.target_runner.device) if rng is None else rng
        target, drafter = self.target_runner, None if tree is None else self._drafter(tree)
        target.reset()
        target.prefill(ids[:-1])
        if drafter is not None:
            drafter.start(ids, sampling, rng)
        draft_forwards0 = self.draft_runner.forwards if self.draft_runner is not None else 0
        stats.prefill_seconds = clock() - t_start

        context = list(ids)
        while not out.done:
            t0 = clock()
            # 1. propose, never deeper than the tokens still wanted (a round emits <= depth + 1)
            depth = 0 if drafter is None else min(tree.max_depth, out.remaining - 1)
            draft = drafter.propose(context, depth) if depth else DraftTree.root_only(context[-1])
            t1 = clock()
            # 2. score every node in one target forward; 3. verify; 4. commit the accepted path
            walk = verify(draft, target.score(draft.tree), sampling, rng, rule)
            target.commit(walk.path)
            t2 = clock()
            if depth:
                drafter.observe(draft, walk)
            stats.record_round(draft, walk, draft_seconds=(t1 - t0) + (clock() - t2), verify_seconds=t2 - t1)
            context += out.add(walk.emitted(draft), walk.kind)

        stats.tokens = len(out.token_ids)
        if self.draft_runner is not None:
            stats.draft_forwards = self.draft_runner.forwards - draft_forwards0
        stats.total_seconds = clock() - t_start
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True) if self.tokenizer is not None else None
        return GenerationOutput(out.token_ids, out.sources, stats, text, out.finish_reason, rule)

    # ---- helpers ---------------------------------------------------------------------------
    def _drafter(self, tree: TreeConfig) -> Drafter:
        if isinstance(self.drafter, Drafter):
            return self.drafter
        if self.drafter == "ngram":
            return NgramDrafter(tree.width)
        if self.drafter == "lookup":
            return PromptLookupDrafter(tree.width)
        if self.draft_runner is None:
            raise ValueError(
                f"drafter={self.drafter!r} needs a draft model; pass draft=..., use drafter='ngram' or "
                f"'lookup', or tree=None for plain decoding"
            )
        model = ModelDrafter(self.draft_runner, tree)
        return model if self.drafter == "model" else MergedDrafter([model, NgramDrafter(tree.width)])

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
            ids = [int(t) for t in prompt]
        if not ids or (isinstance(prompt, str) and not prompt):
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in ids if not 0 <= t < self.target_runner.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.target_runner.vocab_size})")
        for name, run in (("target", self.target_runner), ("draft", self.draft_runner if tree is not None else None)):
            limit = getattr(run, "max_positions", None)
            if limit is not None and len(ids) + max_new_tokens > limit:
                raise ValueError(
                    f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the {name} "
                    f"model's {limit} positions; shorten the prompt or lower max_new_tokens"
                )
        return ids


def _resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype(device)
    if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use 'auto', 'float32' or 'bfloat16'")
    return getattr(torch, dtype)


def _load_runner(path, dtype: torch.dtype, device: torch.device, backend: str) -> Runner:
    """A runner for the checkpoint at `path`: native straight from safetensors when the
    backend allows it and the directory holds a supported checkpoint, else through HF."""
    from .backends import hf

    local = hf.resolve_path(path)
    if backend != "hf" and isinstance(local, Path):
        from .backends.native import NativeRunner, unsupported_reason

        import json

        try:
            config = json.loads((local / "config.json").read_text())
        except ValueError as e:
            raise ValueError(f"{local / 'config.json'} is not valid JSON: {e}") from e
        reason = unsupported_reason(config)
        if reason is None:
            return NativeRunner.from_pretrained(local, dtype=dtype, device=device)
        if backend == "native":
            raise ValueError(f"the native backend cannot run {str(path)!r}: {reason}; use backend='hf'")
    return make_runner(hf.load_model(local, dtype, device), backend)
