"""The decode loop: propose, score, verify, commit.

    prefill(prompt)                        target cache holds all but the last committed token
    while not done:
        draft = drafter.propose(context)   DraftTree rooted at the last committed token
        logits = target.forward(draft)     ONE target forward over every node (tree mask)
        walk = verify(draft, logits)       accepted path + one correction/bonus token
        commit(walk)                       keep the accepted cache slots, drop the rest
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from .config import SamplingConfig, TreeConfig
from .drafters import Drafter, MergedDrafter, ModelDrafter, NgramDrafter, PromptLookupDrafter
from .proposal import DraftTree
from .rng import Rng, TorchRng
from .runner import HFRunner, Runner
from .stats import GenerationOutput, GenerationStats, TokenSource
from .verify import verify

OnTokens = Callable[[list[int], list[TokenSource]], None]


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
    """

    DRAFTERS = ("model", "ngram", "lookup", "merged")

    def __init__(self, target, draft=None, tokenizer=None, drafter: str | Drafter = "model"):
        if not isinstance(drafter, Drafter) and drafter not in self.DRAFTERS:
            raise ValueError(f"drafter must be one of {', '.join(self.DRAFTERS)} or a Drafter, got {drafter!r}")
        self.drafter = drafter
        self.target_model, self.draft_model, self.tokenizer = target, draft, tokenizer
        self._target = target if isinstance(target, Runner) else HFRunner(target)
        self._draft = None if draft is None else draft if isinstance(draft, Runner) else HFRunner(draft)
        if self._draft is not None and self._draft.vocab_size != self._target.vocab_size:
            raise ValueError(
                f"draft and target vocabularies differ ({self._draft.vocab_size} vs "
                f"{self._target.vocab_size} tokens); speculative decoding needs one shared tokenizer"
            )
        self.eos_token_ids = _eos_token_ids(target)

    @classmethod
    def from_pretrained(
        cls,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        dtype: torch.dtype | str | None = None,
        device: torch.device | str | None = None,
        attn_implementation: str = "sdpa",
        drafter: str | Drafter = "model",
    ) -> SpeculativeDecoder:
        """Load target, draft and the target's tokenizer from HF ids or local directories.

        With no arguments, loads the bundled pair (see `treespec.zoo`).
        """
        from transformers import AutoTokenizer

        if target is None and draft is None:
            from .zoo import default_pair

            target, draft = default_pair()
        if target is None:
            raise ValueError("pass target= (an HF id or a local model directory) along with draft=")
        models = [_load_model(p, dtype, device, attn_implementation) if p is not None else None for p in (target, draft)]
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(target))
        except (OSError, ValueError):
            tokenizer = None  # token-id prompts still work
        return cls(models[0], models[1], tokenizer, drafter=drafter)

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
    ) -> GenerationOutput:
        """Generate up to `max_new_tokens` tokens after `prompt` (text or token ids).

        `tree=None` decodes autoregressively with the same runner (the in-library baseline).
        The output is distributed exactly as the target's own sampling under `sampling`
        (at temperature 0: exactly its greedy output). `on_tokens(ids, sources)` is called
        with each round's new tokens, for streaming. `rng` replaces the seeded `TorchRng`
        (the exactness tests pass one that enumerates every outcome).
        """
        ids = self._check(prompt, max_new_tokens, tree, sampling)
        t_start = time.perf_counter()
        stats = GenerationStats()
        if rng is None:
            rng = TorchRng(seed, getattr(self._target, "device", "cpu"))
        target = self._target
        target.reset()
        target.prefill(ids[:-1])
        drafter = None
        if tree is not None:
            drafter = self._drafter(tree)
            drafter.start(ids, sampling, rng)
        stats.prefill_seconds = time.perf_counter() - t_start
        draft_forwards0 = self._draft.forwards if self._draft is not None else 0

        context, out, sources = list(ids), [], []
        finish = "length"
        eos = set() if ignore_eos else self.eos_token_ids
        while len(out) < max_new_tokens:
            # 1. propose: never deeper than the tokens still wanted (a round emits <= depth + 1)
            t0 = time.perf_counter()
            depth = 0 if drafter is None else min(tree.max_depth, max_new_tokens - len(out) - 1)
            draft = drafter.propose(context, depth) if depth else DraftTree.root_only(context[-1])
            t1 = time.perf_counter()
            # 2. score every node in one target forward; 3. verify; 4. commit the accepted path
            base = target.n_slots
            logits = target.forward(draft.tree.tokens, [-1] + [base + p for p in draft.tree.parents[1:]])
            walk = verify(draft, logits, sampling, rng)
            target.commit([base + n for n in walk.path])
            t2 = time.perf_counter()
            if depth:
                drafter.observe(draft, walk)
            t3 = time.perf_counter()
            stats.draft_seconds += (t1 - t0) + (t3 - t2)
            stats.verify_seconds += t2 - t1
            stats.target_steps += 1
            stats.tree_nodes += len(draft.tree) - 1
            tree_depths = draft.tree.depths
            stats.record_walk([tree_depths[n] for n in walk.path if draft.groups_at(n)], len(walk.path) - 1)

            new = walk.emitted(draft)
            kinds: list[TokenSource] = ["accepted"] * (len(new) - 1) + [walk.kind]
            new, kinds = new[: max_new_tokens - len(out)], kinds[: max_new_tokens - len(out)]
            for i, t in enumerate(new):
                if t in eos:
                    new, kinds, finish = new[: i + 1], kinds[: i + 1], "eos"
                    break
            out += new
            sources += kinds
            context += new
            if on_tokens is not None:
                on_tokens(new, kinds)
            if finish == "eos":
                break

        stats.tokens = len(out)
        if self._draft is not None:
            stats.draft_forwards = self._draft.forwards - draft_forwards0
        stats.total_seconds = time.perf_counter() - t_start
        text = self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer is not None else None
        return GenerationOutput(token_ids=out, sources=sources, stats=stats, text=text, finish_reason=finish)

    # ---- helpers ---------------------------------------------------------------------------
    def _drafter(self, tree: TreeConfig) -> Drafter:
        if isinstance(self.drafter, Drafter):
            return self.drafter
        if self.drafter == "ngram":
            return NgramDrafter(tree.width)
        if self.drafter == "lookup":
            return PromptLookupDrafter(tree.width)
        if self._draft is None:
            raise ValueError(
                f"drafter={self.drafter!r} needs a draft model; pass draft=..., use drafter='ngram' or "
                f"'lookup', or tree=None for plain decoding"
            )
        model = ModelDrafter(self._draft, tree)
        return model if self.drafter == "model" else MergedDrafter([model, NgramDrafter(tree.width)])

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
        bad = [t for t in ids if not 0 <= t < self._target.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self._target.vocab_size})")
        for name, run in (("target", self._target), ("draft", self._draft if tree is not None else None)):
            limit = getattr(run, "max_positions", None)
            if limit is not None and len(ids) + max_new_tokens > limit:
                raise ValueError(
                    f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the {name} "
                    f"model's {limit} positions; shorten the prompt or lower max_new_tokens"
                )
        return ids


def _eos_token_ids(model) -> set[int]:
    """EOS ids from the model's generation config (falling back to its config)."""
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None), model):
        eos = getattr(cfg, "eos_token_id", None)
        if eos is None:
            eos = getattr(cfg, "eos_token_ids", None)
        if eos is not None:
            return {int(e) for e in ([eos] if isinstance(eos, int) else eos)}
    return set()


def _load_model(path, dtype, device, attn_implementation):
    from transformers import AutoModelForCausalLM

    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'float32' or 'bfloat16'")
        dtype = getattr(torch, dtype)
    local = Path(path).expanduser()
    if isinstance(path, Path) or str(path).startswith((".", "/", "~")) or local.exists():
        if not (local / "config.json").is_file():
            raise ValueError(f"no model at {str(path)!r}: expected a directory with config.json and weights")
        path = local
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype if dtype is not None else torch.float32, attn_implementation=attn_implementation
        )
    except (OSError, ValueError) as e:
        raise ValueError(
            f"cannot load a causal LM from {str(path)!r}: {str(e).splitlines()[0]} "
            f"(give a local directory with config.json and weights, or a hub id that is cached)"
        ) from e
    if device is not None:
        model = model.to(device)
    return model.eval()
