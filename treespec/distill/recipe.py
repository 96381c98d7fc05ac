"""The distillation recipe: every knob of `treespec distill`, checked before any work starts.

One frozen dataclass is the single source of truth: `distill(**recipe)` takes its fields as
keyword arguments, the CLI turns each field into a `--flag` (help text = the field's comment)
and `distill.json` records it. Defaults are the measured choices for the bundled pycode pair
(docs/distill.md has the measurements).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

LOSSES = ("kl", "tv", "jsd")
EMBEDDINGS = ("pca", "random")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Recipe:
    # ---- data: the target's own responses to prompts, stored as top-k distributions
    max_prompts: int | None = None  # training prompts at most (None: as many as the budget allows)
    prompt_tokens: int = 192  # a prompt longer than this is cut (text) or skipped (chat)
    response_tokens: int = 64  # tokens the target samples after each prompt
    temperature: float = 1.0  # sampling temperature of the target's responses
    top_k: int = 32  # target probabilities kept per position (int32 ids + float16 probs)
    train_on_prompt: bool = True  # also learn the target's distributions at prompt positions
    gen_batch: int = 16  # prompts per generate_batch call and per data shard
    data_fraction: float = 0.4  # share of --minutes spent making data
    target_dtype: str = "float32"  # the target's dtype while it makes data and is evaluated
    # ---- draft model (LlamaForCausalLM)
    layers: int = 2  # decoder layers
    from_target: bool = False  # copy the target's first layers-1 and last layer, at its width
    hidden_size: int | None = None  # None: the target's hidden size / 4 (a multiple of head_dim)
    head_dim: int = 32  # attention head size; heads = hidden_size / head_dim
    kv_heads: int | None = None  # key/value heads (None: half the query heads)
    intermediate_size: int | None = None  # MLP width (None: 3 x hidden_size)
    embeddings: str = "pca"  # "pca": the target's embedding on its top principal directions
    freeze_embeddings: bool = False  # keep the (tied) embedding matrix as initialised
    vocab_subset: int | None = None  # keep only the K tokens the target emits most (q = 0 elsewhere)
    # ---- training
    loss: str = "kl"  # "kl" (forward KL), "tv" (total variation) or "jsd" on the top-k buckets
    steps: int | None = None  # optimizer steps (None: what fits in --minutes, else `epochs`)
    epochs: float = 3.0  # passes over the data when neither --minutes nor --steps is given
    batch_size: int = 16  # sequences per step
    lr: float = 3e-3  # peak AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 20  # linear warm-up, then cosine decay to min_lr_ratio x lr
    min_lr_ratio: float = 0.1  # final learning rate / peak
    grad_clip: float = 1.0  # max gradient norm
    drafts: int = 1  # boost-tuned drafts trained in sequence (SpecInfer)
    seed: int = 0  # seeds data order, sampling and initialisation
    # ---- evaluation, checkpoints, machine
    evals: int = 5  # held-out evaluations during training (plus one at step 0)
    eval_prompts: int = 8  # held-out prompts decoded per evaluation
    eval_tokens: int = 32  # new tokens per held-out prompt
    proxy_prompts: int = 16  # held-out prompts whose stored distributions give 1 - TV
    checkpoint_minutes: float = 2.0  # minutes between checkpoints (0: after every step)
    save_dtype: str = "bfloat16"  # dtype of the saved draft weights
    threads: int | None = None  # torch CPU threads (None: torch's default)
    device: str = "cpu"  # where the target and the draft run
    progress: bool = True  # a tqdm progress bar

    def __post_init__(self) -> None:
        positive = (
            "prompt_tokens",
            "response_tokens",
            "top_k",
            "gen_batch",
            "layers",
            "head_dim",
            "batch_size",
            "drafts",
            "eval_prompts",
            "eval_tokens",
            "proxy_prompts",
        )
        for name in positive + (
            "max_prompts",
            "hidden_size",
            "kv_heads",
            "intermediate_size",
            "vocab_subset",
            "steps",
            "threads",
        ):
            value = getattr(self, name)
            if value is None and name not in positive:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in (
            "temperature",
            "lr",
            "epochs",
            "data_fraction",
            "min_lr_ratio",
            "grad_clip",
            "weight_decay",
            "checkpoint_minutes",
        ):
            value = getattr(self, name)
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if not 0 < self.data_fraction < 1:
            raise ValueError(f"data_fraction must be in (0, 1), got {self.data_fraction!r}")
        if self.lr <= 0 or self.epochs <= 0 or self.min_lr_ratio > 1:
            raise ValueError("lr and epochs must be > 0 and min_lr_ratio <= 1")
        if (
            not isinstance(self.evals, int)
            or self.evals < 0
            or not isinstance(self.warmup_steps, int)
            or self.warmup_steps < 0
        ):
            raise ValueError(
                f"evals and warmup_steps must be integers >= 0, got {self.evals!r}, {self.warmup_steps!r}"
            )
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.embeddings not in EMBEDDINGS:
            raise ValueError(f"embeddings must be one of {', '.join(EMBEDDINGS)}, got {self.embeddings!r}")
        for name in ("save_dtype", "target_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {', '.join(DTYPES)}, got {getattr(self, name)!r}")
        if self.from_target:
            shaped = [n for n in ("hidden_size", "kv_heads", "intermediate_size") if getattr(self, n)]
            if shaped or self.embeddings != "pca":
                raise ValueError(
                    "from_target takes the target's shape and embedding: leave "
                    f"{', '.join(shaped) or 'embeddings'} unset"
                )
        if self.hidden_size is not None and self.hidden_size % self.head_dim:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of head_dim {self.head_dim}")

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> Recipe:
        """A recipe from `distill(**recipe)` keywords; an unknown name is a ValueError."""
        check_known(cls, kwargs, "recipe")
        return cls(**kwargs)


def check_known(recipe_class, kwargs: dict, what: str) -> None:
    """ValueError naming the keywords that are not fields of the dataclass `recipe_class`."""
    known = {f.name for f in fields(recipe_class)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown {what} option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
