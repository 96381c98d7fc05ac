"""User-facing configuration: how to sample, and what shape of draft tree to build.

Both dataclasses validate themselves on construction, so a bad value fails at the call
site with a message that says what to change, never deep inside a decode loop.

How many nodes a tree holds, by name (root excluded throughout):

    TreeConfig.max_nodes   the most draft nodes one round of this tree can hold
    MAX_TREE_NODES         the most any tree may hold (`max_nodes` above it is refused)
    AUTO_MAX_NODES         the automatic tree's `max_nodes`
    TreeConfig.budget      "dynamic": the nodes a round keeps after drafting (`effective_budget`)
    shared_tree_nodes      (`SpeculativeDecoder.engine`) above it, a request sharing a round decodes
                           plainly; a server's --max-tree-nodes refuses larger trees outright

How a tree's siblings are drawn has three names for three concepts (`TreeConfig.strategy`,
`proposal.Draw`, `rules.Siblings`): `treespec.rules` says which is which.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

Strategy = Literal["auto", "iid", "without_replacement", "topk", "dynamic", "sequoia"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)
# The automatic tree (`TreeConfig()`, `treespec.planning`) holds at most this many draft nodes
# and is at most this deep.
AUTO_MAX_NODES = 16
AUTO_MAX_DEPTH = 8
# the depth policies of `TreeConfig.adaptive` (`treespec.planning.DepthPolicy`)
ADAPTIVE: tuple[str, ...] = ("hf", "entropy")
# who proposes (`treespec.drafters.DrafterFactory`): a draft model, a feature head, n-gram
# tables, prompt lookup, or a draft model and n-grams merged
DRAFTER_KINDS: tuple[str, ...] = ("model", "head", "ngram", "lookup", "merged")
# the drafter kinds that draft along any tree shape; the others propose chains of their own making
SHAPED_DRAFTERS: tuple[str, ...] = ("model", "head")
# weight-only formats of the native backend's products (`treespec.backends.linear`): int8 with a
# scale per row; int4 in groups of 32 (a GGUF file's Q4_0 / Q4_1 blocks as they are); q4q8: the
# same 4-bit weights times activations rounded to int8 per row and group (`kernels.q4q8`)
QUANTIZATIONS: tuple[str, ...] = ("int8", "int4", "q4q8")

# The most draft nodes one round may hold. The target scores every node in one forward
# ([nodes, vocab] logits: 1024 x 128256 fp32 is 0.5 GB), so a larger tree is rejected up
# front instead of hanging or allocating gigabytes mid-generation.
MAX_TREE_NODES = 1024
# Below this, logits / temperature overflows float32 for ordinary logit magnitudes
# (|logit| ~ 1e2: 1e2 / 1e-37 = inf) and the softmax turns into NaN. Use 0 for greedy.
MIN_TEMPERATURE = 1e-6
# Penalties beyond this (frequency/presence: |value|; repetition: value or 1/value) already
# exclude or force a token outright, and larger ones overflow float16/bfloat16/float32 logits
# (1e39 * count is inf), turning a request's distributions into NaN.
MAX_PENALTY = 1e3


@dataclass(frozen=True)
class SamplingConfig:
    """Sampling transforms, applied identically to the target (p) and the draft (q).

    Penalties act on the logits first, in this order, then temperature, top-k and top-p (the
    order of Hugging Face's and vLLM's logits processors). They read the context each
    distribution is sampled after: the committed sequence, and for a tree node also the
    tokens on its own root-to-node path (so siblings see different contexts).

    - `repetition_penalty` (Hugging Face / CTRL): for every token id anywhere in the context,
      prompt included, a logit > 0 is divided by it and a logit < 0 multiplied by it. 1 = off.
    - `frequency_penalty`, `presence_penalty` (OpenAI / vLLM): logit -= frequency_penalty *
      count + presence_penalty * (count > 0), where count is the token's occurrences among the
      generated tokens only (vLLM's semantics: the prompt is not counted). 0 = off.

    At temperature 0 the argmax is taken after the penalties, as Hugging Face's greedy
    `generate(repetition_penalty=...)` does.
    """

    temperature: float = 1.0  # 0 = greedy (argmax of the penalised logits); > 0 divides the logits
    top_k: int | None = None  # keep the k most likely tokens; None or 0 = keep all
    top_p: float = 1.0  # nucleus: smallest set whose mass reaches top_p, in (0, 1]
    repetition_penalty: float = 1.0  # > 0; tokens in prompt + generated text: logit / or * it
    frequency_penalty: float = 0.0  # logit -= it * count in the generated text
    presence_penalty: float = 0.0  # logit -= it if the token occurs in the generated text

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature {t!r} is so small that logits / temperature overflows; use temperature=0 "
                f"for greedy decoding or a value >= {MIN_TEMPERATURE:g}"
            )
        if self.top_k is not None and (
            not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0
        ):
            raise ValueError(f"top_k must be None or an integer >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        r = self.repetition_penalty
        if _is_number(r) and math.isfinite(r) and r > 0 and not 1 / MAX_PENALTY <= r <= MAX_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in [{1 / MAX_PENALTY:g}, {MAX_PENALTY:g}] (beyond, "
                "logits overflow "
                f"low-precision dtypes; {MAX_PENALTY:g} already excludes a repeated token), got {r!r}"
            )
        if not _is_number(r) or not math.isfinite(r) or r <= 0:
            raise ValueError(
                "repetition_penalty must be a finite number > 0 (1 = off, > 1 discourages "
                f"repeats), got {r!r}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not math.isfinite(v):
                raise ValueError(
                    f"{name} must be a finite number (0 = off, > 0 discourages repeats), got {v!r}"
                )
            if abs(v) > MAX_PENALTY:
                raise ValueError(
                    f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (beyond, logits overflow "
                    f"low-precision dtypes; {MAX_PENALTY:g} already excludes a repeated token), got {v!r}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (the distributions then depend on the context)."""
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0


def check_positive_int(name: str, value, none_ok: bool = False) -> None:
    """ValueError unless `value` is an int >= 1 (or None, if `none_ok`), naming `name`."""
    check_int_at_least(name, value, 1, none_ok)


def check_int_at_least(name: str, value, minimum: int, none_ok: bool = False) -> None:
    """ValueError unless `value` is an int >= `minimum` (or None, if `none_ok`), naming `name`."""
    if value is None and none_ok:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(
            f"{name} must be {'None or ' if none_ok else ''}an integer >= {minimum}, got {value!r}"
        )


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the draft tree proposed each round.

    `TreeConfig()` (no shape given, or `strategy="auto"`) is the automatic tree: for each
    request, the shape with the most expected tokens per second on this machine, from the
    drafter's measured acceptance and the target's measured costs, or plain decoding where no
    shape beats it (`treespec.planning`). Giving `width`, `depth` or another field fixes the
    shape: `TreeConfig(width=1, depth=4)` is a chain of 4, whatever the machine.

    `width=1` is linear speculative decoding (Leviathan et al. 2023, Algorithm 1) for every
    strategy. Per strategy:

    - "iid" (the default once a shape is given): `width` draft sequences of `depth` tokens,
      each sampled independently from the draft model, merged into a prefix tree. The m
      sequences through a node are m i.i.d. proposals there (duplicates are kept as separate
      trials). At most `width * depth` nodes.
    - "without_replacement": stochastic beam. Each expanded node gets `width` distinct
      children drawn without replacement from q (Gumbel-top-k); at each depth the `width`
      frontier nodes with the highest draft path probability are expanded further.
      At most `width + (depth - 1) * width**2` nodes.
    - "topk": deterministic beam. Each expanded node proposes its `width` most likely draft
      tokens; at each depth the `width` children with the highest draft path probability
      are kept (best-first by path probability). At most `width * depth` nodes.
    - "dynamic" (EAGLE-2): like "topk", but every one of the `width` expanded nodes keeps
      all its `width` children; after the last depth the `budget` nodes with the highest
      draft path probability are kept (an ancestor-closed set). Deterministic proposals.
    - "sequoia": expand along a fixed `shape` (a `treespec.sequoia.TreeShape`, e.g. from
      `optimal_shape` or `TreeShape.load`), cut at `depth`: a node with c children in the
      shape draws c distinct tokens without replacement from q (Gumbel-top-k), the k-th draw
      going to the shape's k-th child. `width` is unused.
    - "auto": see above.

    Two decisions the decode loop takes after each round, for every drafter
    (`treespec.planning.DepthPolicy`), each its own field:
    - `adaptive`, how deep the next round drafts: None keeps `depth`; "hf" is Hugging Face's
      heuristic (depth + 2 after a fully accepted round, - 1 otherwise); "entropy" is
      EGAG-style (the EMA, factor `ema_beta`, of the draft's normalised entropy along the
      accepted path maps linearly onto [depth_min, depth_max]: a confident draft goes
      deeper; drafters without a distribution, n-gram and lookup, use the round's rejection
      rate, 1 - accepted / depth, instead). Both stay within [depth_min, depth_max], starting
      at `depth`.
    - `plain_fallback`, whether the next round drafts at all: per request, speculative or
      plain rounds, by which has measured more tokens per second for this request so far
      (`treespec.planning.GoodputSwitch`): speculation where this draft pays on this text and
      hardware, plain decoding where it does not. Decisions follow past timings, so at
      temperature > 0 an output is exact but no longer reproducible from its seed alone.
      The automatic tree needs no such flag: its plan already includes plain decoding.

    At temperature 0 the draft is read greedily: "iid" proposes the draft's argmax chain
    (its samples would all be equal), "without_replacement" takes the draft's top tokens
    in order (the zero-temperature limit of Gumbel-top-k), "topk" is unchanged.
    """

    # Fields that apply to one strategy or policy each (the others ignore them): `budget` to
    # "dynamic" and `shape` to "sequoia" (both refused elsewhere); `width` to every strategy but
    # "sequoia"; `depth_min`, `depth_max` to `adaptive` depth, `ema_beta` to adaptive="entropy".
    width: int | None = None  # branching: sequences ("iid") or children per node / beam size (1)
    depth: int | None = None  # draft tokens per branch; a round emits 1 .. depth + 1 tokens (6)
    strategy: Strategy | None = None  # see the class docstring; None: "auto" if no shape is given
    budget: int | None = None  # "dynamic": draft nodes kept per round (default width * depth)
    adaptive: str | None = None  # the depth policy: None (fixed depth), "hf" or "entropy"
    plain_fallback: bool = False  # per request, plain rounds where they measure faster
    depth_min: int = 1  # adaptive depth lower bound
    depth_max: int = 8  # adaptive depth upper bound
    ema_beta: float = 0.8  # adaptive="entropy": weight of the past in the entropy EMA, in [0, 1)
    shape: object = None  # "sequoia": the TreeShape to draft along

    def __post_init__(self) -> None:
        given = [n for n in ("width", "depth", "budget", "shape", "adaptive") if getattr(self, n) is not None]
        given += ["plain_fallback"] if self.plain_fallback is not False else []
        if self.strategy is None:
            object.__setattr__(self, "strategy", "iid" if given else "auto")
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"TreeConfig.strategy must be one of {', '.join(STRATEGIES)}; got {self.strategy!r}"
            )
        if self.strategy == "auto":
            if given:
                raise ValueError(
                    f"TreeConfig(strategy='auto') chooses the shape itself; leave {', '.join(given)} "
                    "unset, or give a strategy to fix the shape"
                )
            return
        if self.width is None:
            object.__setattr__(self, "width", 1)
        if self.depth is None:
            object.__setattr__(self, "depth", 6)
        for name in ("width", "depth", "depth_min", "depth_max", "budget"):
            check_positive_int(f"TreeConfig.{name}", getattr(self, name), none_ok=name == "budget")
        if self.budget is not None and self.strategy != "dynamic":
            raise ValueError("TreeConfig.budget applies to strategy='dynamic' only")
        if (self.strategy == "sequoia") != (self.shape is not None):
            raise ValueError("TreeConfig.shape is required by, and only used with, strategy='sequoia'")
        if self.shape is not None and not hasattr(self.shape, "children"):
            raise ValueError("TreeConfig.shape must be a treespec.sequoia.TreeShape (see TreeShape.load)")
        if self.adaptive is not None and self.adaptive not in ADAPTIVE:
            raise ValueError(
                f"TreeConfig.adaptive (the depth policy) must be None, 'hf' or 'entropy', got "
                f"{self.adaptive!r}; plain rounds where they measure faster are plain_fallback=True"
            )
        if not isinstance(self.plain_fallback, bool):
            raise ValueError(f"TreeConfig.plain_fallback must be True or False, got {self.plain_fallback!r}")
        if self.adaptive is not None and not self.depth_min <= self.depth <= self.depth_max:
            raise ValueError(
                f"adaptive depth needs depth_min <= depth <= depth_max, got {self.depth_min}, "
                f"{self.depth}, {self.depth_max}"
            )
        b = self.ema_beta
        if not isinstance(b, (int, float)) or isinstance(b, bool) or not 0 <= b < 1:
            raise ValueError(f"TreeConfig.ema_beta must be in [0, 1), got {self.ema_beta!r}")
        if self.max_nodes > MAX_TREE_NODES:
            depth = f"depth_max={self.depth_max}" if self.adaptive is not None else f"depth={self.depth}"
            depth += f", budget={self.budget}" if self.budget is not None else ""
            raise ValueError(
                f"TreeConfig(width={self.width}, {depth}, strategy={self.strategy!r}) drafts up to "
                f"{self.max_nodes} nodes per round; the limit is {MAX_TREE_NODES} "
                f"(treespec.config.MAX_TREE_NODES): lower width, depth or budget"
            )

    @property
    def auto(self) -> bool:
        """The automatic tree: each request's shape is chosen when it is added."""
        return self.strategy == "auto"

    @property
    def max_depth(self) -> int:
        """The deepest a round can go."""
        if self.auto:
            return AUTO_MAX_DEPTH
        return self.depth_max if self.adaptive is not None else self.depth

    @property
    def max_nodes(self) -> int:
        """The most draft nodes a round can hold (root excluded); for "dynamic", the nodes
        drafted before the `budget` cut, which the draft model scores."""
        if self.auto:
            return AUTO_MAX_NODES
        w, d = self.width, self.max_depth
        if self.strategy == "sequoia":
            return getattr(self.shape, "n_nodes", 0)
        if self.strategy in ("without_replacement", "dynamic"):
            n = w + (d - 1) * w * w
            return max(n, self.budget or 0)
        return w * d

    @property
    def effective_budget(self) -> int:
        """ "dynamic": the draft nodes a round keeps, `budget` or by default width * depth."""
        return self.budget if self.budget is not None else self.width * self.depth


def default_cache_dir() -> Path:
    """Where what is made once per machine and model is kept (converted GGUF files, measured
    costs, compiled graphs): $TREESPEC_CACHE, or ~/.cache/treespec."""
    return Path(os.environ.get("TREESPEC_CACHE") or "~/.cache/treespec").expanduser()


def write_cache_json(path: Path, data, replace: bool = True) -> bool:
    """Write `data` to `path` whole (a temporary file, then a rename; `replace=False`: only if
    no file is there, so a concurrent first writer wins). Whether the cache is writable: a
    read-only cache keeps nothing, never an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, default=str)
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails where another process wrote first
            except FileExistsError:
                pass
            os.unlink(tmp)
        return True
    except OSError:
        return False  # a read-only cache: nothing kept
