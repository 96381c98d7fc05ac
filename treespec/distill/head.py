"""Training a feature head (EAGLE-3) for a target, on `treespec distill`'s on-policy data.

    treespec distill --head --target T --out DIR --data-from RUN [RUN ...] --minutes M [--resume]

    features   one teacher-forced pass of the target over every stored sequence, its taps (the
               inputs of layers {2, N/2, N-3}) kept in bf16 in a memory-mapped file beside each
               data run's shards (computed once, resumable chunk by chunk, read by every head
               trained on that run with those taps): the only target forwards of training
    train      the head reads (f_t, token t+1) and learns the target's distribution of token t+2
               (forward KL on the stored top-k and its tail, as a draft model learns it:
               `losses.buckets`), then again on its OWN output states for `unroll` more steps
               (EAGLE-3's training-time test): step j's slot t reads step j-1's state at slot
               t-1 and attends to the target-fed slots <= t-j and its own chain of unrolled
               slots, exactly what a node j levels below the root sees when drafting; step j's
               loss weighs 0.8^j. The loop is the draft's (`train.train_model`): seeded order,
               warm-up then cosine over the step count or the time budget, checkpoints, a resume
               that reproduces the uninterrupted run bit for bit, a progress bar
    evaluate   at step 0 and `evals` times: held-out acceptance by depth through
               `SpeculativeDecoder` (a chain of depth 4, T=0 and T=1) and the proxy on held-out
               stored distributions (top-1 agreement, sum of min(p, q)): eval.jsonl
    save       an EAGLE-3 checkpoint (`treespec.backends.head.save_head`) and head.json

The head starts as a copy of the target's last stage: its LM head is the target's output rows
of the draft vocabulary, its final norm the target's, and fc passes the last tap through, so
at step 0 it already predicts what the target's late features say. `init_from` starts it from
an EAGLE-3 checkpoint instead (a shipped or published head, trained on): its taps and rows.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..backends.base import prefill_many
from ..backends.head import HeadConfig, default_taps, head_weight_shapes
from .data import Dataset, load_shard
from .evaluate import read_jsonl
from .losses import alpha_lower_bound, buckets, divergence
from .recipe import check_known
from .train import Clock, Job, train_model

DECAY = 0.8  # EAGLE-3: step j of the unrolled test weighs DECAY ** j
FEATURE_CHUNK_TOKENS = 4096  # target tokens per features forward (packed lanes)


@dataclass(frozen=True)
class HeadRecipe:
    """Every knob of `treespec distill --head`; recorded in head.json, fixed for a resumed run
    (but the machine fields: `progress`, `threads`, `checkpoint_minutes`)."""

    taps: tuple[int, ...] | None = None  # target layers read (None: EAGLE-3's 2, N/2, N-3)
    unroll: int = 2  # training-time test: steps on the head's own output states
    vocab_subset: int = 8192  # the head's rows: the ids the target emits most in the data
    freeze_lm_head: bool = False  # keep the target's output rows as the head's LM head
    init_from: str | None = None  # an EAGLE-3 head to start from (its taps and rows, not vocab_subset's)
    batch_size: int = 8  # sequences per step
    lr: float = 1e-3  # peak AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    warmup_steps: int = 20  # linear warm-up, then cosine decay to min_lr_ratio x lr
    min_lr_ratio: float = 0.1  # final learning rate / peak
    grad_clip: float = 1.0  # max gradient norm
    steps: int | None = None  # optimizer steps (None: what fits in --minutes, else `epochs`)
    epochs: float = 1.0  # passes over the data when neither --minutes nor --steps is given
    evals: int = 4  # held-out evaluations during training (plus one at step 0)
    eval_prompts: int = 16  # held-out prompts decoded per evaluation
    eval_tokens: int = 48  # new tokens per held-out prompt
    dtype: str = "bfloat16"  # the target's dtype for its features and the evaluations
    seed: int = 0  # data order and the layer's initialisation
    checkpoint_minutes: float = 2.0  # minutes between checkpoints (0: after every step)
    threads: int | None = None  # torch CPU threads (None: torch's default)
    progress: bool = True  # a tqdm progress bar
    acceptance: bool = True  # measure acceptance.json beside the saved head (the automatic tree's input)

    MACHINE = ("progress", "threads", "checkpoint_minutes", "acceptance")

    def __post_init__(self) -> None:
        for name in (
            "vocab_subset",
            "batch_size",
            "evals",
            "eval_prompts",
            "eval_tokens",
            "steps",
            "threads",
        ):
            v = getattr(self, name)
            if v is None and name in ("steps", "threads"):
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "evals" else 1):
                raise ValueError(f"{name} must be an integer >= {0 if name == 'evals' else 1}, got {v!r}")
        if not isinstance(self.unroll, int) or isinstance(self.unroll, bool) or self.unroll < 0:
            raise ValueError(f"unroll must be an integer >= 0, got {self.unroll!r}")
        for name in ("lr", "weight_decay", "min_lr_ratio", "grad_clip", "epochs", "checkpoint_minutes"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.lr <= 0 or self.epochs <= 0 or self.min_lr_ratio > 1:
            raise ValueError("lr and epochs must be > 0 and min_lr_ratio <= 1")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.taps is not None and (
            not self.taps or not all(isinstance(t, int) and t >= 0 for t in self.taps)
        ):
            raise ValueError(f"taps must be target layer numbers >= 0, got {self.taps!r}")
        if self.init_from is not None and not isinstance(self.init_from, str):
            raise ValueError(f"init_from must be a head directory's path (a string), got {self.init_from!r}")

    def as_dict(self) -> dict:
        out = asdict(self)
        out["taps"] = None if self.taps is None else list(self.taps)
        return out

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> HeadRecipe:
        check_known(cls, kwargs, "head recipe")
        if kwargs.get("taps") is not None:
            kwargs = {**kwargs, "taps": tuple(kwargs["taps"])}
        return cls(**kwargs)


# ---- the target's features --------------------------------------------------------------------
class Features:
    """The target's tapped features at every stored token of one data run, [T, F] bf16, aligned
    with its `tokens`, in a memory-mapped .npy file (bf16 bits as uint16): 3 x 576 x 2 bytes a
    token for SmolLM2's three taps, so millions of tokens stay on disk and in the page cache."""

    def __init__(self, path: Path, shape: tuple[int, int] | None = None):
        mode = "r+" if shape is None else "w+"
        self.array = np.lib.format.open_memmap(path, mode=mode, dtype=np.uint16, shape=shape)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(self.array[rows])).view(torch.bfloat16)

    def write(self, start: int, values: torch.Tensor) -> None:
        self.array[start : start + len(values)] = values.to(torch.bfloat16).view(torch.uint16).numpy()

    def flush(self) -> None:
        self.array.flush()


class FeatureSet:
    """Several runs' `Features` as one [T, F] array over their concatenated tokens (a slice
    never crosses from one run into the next: it is one sequence's)."""

    def __init__(self, parts: list[Features]):
        self.parts = parts
        self.starts = np.cumsum([0] + [len(f.array) for f in parts])

    def __getitem__(self, rows: slice) -> torch.Tensor:
        i = int(np.searchsorted(self.starts, rows.start, side="right")) - 1
        a = self.starts[i]
        return self.parts[i][rows.start - a : rows.stop - a]


def compute_features(target, data: Dataset, taps, store, done: int = 0, on_chunk=None) -> None:
    """The target's tapped features of `data`'s sequences from sequence `done` on, written into
    `store` (a `Features`, or anything with `write(start, tensor)`), sequences prefilled as
    packed native lanes, `FEATURE_CHUNK_TOKENS` a forward; `on_chunk(sequences_done)` after each."""
    target.set_taps(tuple(taps))
    seqs = data.sequences()
    try:
        i = done
        while i < len(seqs):
            n, total = 0, 0
            while i + n < len(seqs) and (n == 0 or total + len(seqs[i + n]) <= FEATURE_CHUNK_TOKENS):
                total += len(seqs[i + n])
                n += 1
            scores = prefill_many([(lane, s.tolist()) for lane, s in zip(target.lanes(n), seqs[i : i + n])])
            store.write(int(data.offsets[i]), torch.cat([s.features for s in scores]))
            i += n
            if on_chunk is not None:
                on_chunk(i)
    finally:
        target.set_taps(())


class FeaturesInMemory:
    """`Features` held in memory, [T, F] bf16: a held-out set's, small enough to recompute."""

    def __init__(self, tokens: int, width: int):
        self.values = torch.zeros(tokens, width, dtype=torch.bfloat16)

    def write(self, start: int, values: torch.Tensor) -> None:
        self.values[start : start + len(values)] = values.to(torch.bfloat16)

    def __getitem__(self, rows: slice) -> torch.Tensor:
        return self.values[rows]


# ---- the model ---------------------------------------------------------------------------------
class HeadModel(torch.nn.Module):
    """The head's weights as trainable parameters (EAGLE-3 names), the target's embedding frozen."""

    def __init__(self, cfg: HeadConfig, embed: torch.Tensor, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("embed", embed.float(), persistent=False)
        self.register_buffer(
            "ids", torch.arange(cfg.draft_vocab_size) + weights["d2t"].long(), persistent=False
        )
        self.names = [n for n in weights if n not in ("d2t", "t2d")]
        self.params = torch.nn.ParameterDict(
            {n.replace(".", "__"): torch.nn.Parameter(weights[n].float().clone()) for n in self.names}
        )
        self.t2d = weights["t2d"]

    def row_of(self, vocab: int) -> torch.Tensor:
        """[vocab] the head's row of each target id, -1 where it has none (what `head_batch` maps
        the stored ids with)."""
        rows = torch.full((vocab,), -1, dtype=torch.long)
        rows[self.ids] = torch.arange(len(self.ids))
        return rows

    def w(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "__")]

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors of an EAGLE-3 checkpoint."""
        out = {n: self.w(n).detach().clone() for n in self.names}
        out["d2t"] = self.ids - torch.arange(self.cfg.draft_vocab_size)
        out["t2d"] = self.t2d
        return out

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.w(name) * F.rms_norm(x, x.shape[-1:], eps=self.cfg.rms_norm_eps)

    def _rope(self, L: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        D = self.cfg.head_dim
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, D, 2, device=device).float() / D))
        ang = torch.arange(L, device=device).float()[:, None] * inv[None]
        emb = torch.cat([ang, ang], -1)
        return emb.cos(), emb.sin()  # [L, D]

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, unroll: int) -> list[torch.Tensor]:
        """features [B, L, F] (slot t: the target's at position t), tokens [B, L] (slot t: token
        t+1); the logits over the head's K rows at every slot for steps 0 .. unroll, [B, L, K]
        each (step j's slots t < j read no state: their rows mean nothing)."""
        return [self.logits(out) for out in self.states(features, tokens, unroll)]

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Output states [..., H] -> logits over the head's K rows [..., K]."""
        return self._norm(states, "norm.weight") @ self.w("lm_head.weight").T

    def states(self, features: torch.Tensor, tokens: torch.Tensor, unroll: int) -> list[torch.Tensor]:
        """The output states [B, L, H] of steps 0 .. unroll (`forward`'s, before the LM head:
        the loss needs logits at its target slots only, a fraction of B x L)."""
        cfg = self.cfg
        B, L = tokens.shape
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        g = Hq // Hkv
        cos, sin = self._rope(L, tokens.device)
        cos, sin = cos[None, None], sin[None, None]  # [1, 1, L, D]: slot t sits at position t
        e = self._norm(F.embedding(tokens, self.embed), "midlayer.input_layernorm.weight")  # [B, L, H]
        h = features.float() @ self.w("fc.weight").T  # [B, L, H]
        a_, m_ = "midlayer.self_attn.", "midlayer.mlp."
        keys, values, states = [], [], []
        for j in range(unroll + 1):
            x = torch.cat([e, self._norm(h, "midlayer.hidden_norm.weight")], -1)  # [B, L, 2H]
            q = self._rotate((x @ self.w(a_ + "q_proj.weight").T).view(B, L, Hq, D).transpose(1, 2), cos, sin)
            k = self._rotate(
                (x @ self.w(a_ + "k_proj.weight").T).view(B, L, Hkv, D).transpose(1, 2), cos, sin
            )
            v = (x @ self.w(a_ + "v_proj.weight").T).view(B, L, Hkv, D).transpose(1, 2)
            keys.append(k.repeat_interleave(g, 1))  # [B, Hq, L, D]
            values.append(v.repeat_interleave(g, 1))
            # slot t at step j sees the target-fed slots s <= t - j and, for i = 1..j, its own
            # step-i ancestor at slot t - j + i (K_i shifted down by j - i: row t reads t - j + i)
            seen = torch.ones(L, L, dtype=torch.bool, device=tokens.device).tril(-j)
            scores = [(q @ keys[0].transpose(-1, -2)).masked_fill(~seen, float("-inf"))]  # [B, Hq, L, L]
            for i in range(1, j + 1):
                scores.append((q * torch.roll(keys[i], j - i, dims=2)).sum(-1, keepdim=True))  # [B, Hq, L, 1]
            p = torch.softmax(torch.cat(scores, -1) / math.sqrt(D), -1)  # [B, Hq, L, L + j]
            o = p[..., :L] @ values[0]
            for i in range(1, j + 1):
                o = o + p[..., L + i - 1 : L + i] * torch.roll(values[i], j - i, dims=2)
            o = o.transpose(1, 2).reshape(B, L, Hq * D)
            a = o @ self.w(a_ + "o_proj.weight").T + h
            n = self._norm(a, "midlayer.post_attention_layernorm.weight")
            mlp = F.silu(n @ self.w(m_ + "gate_proj.weight").T) * (n @ self.w(m_ + "up_proj.weight").T)
            out = mlp @ self.w(m_ + "down_proj.weight").T + a  # [B, L, H]: the output state
            states.append(out)
            h = torch.roll(out, 1, dims=1)  # the next step's slot t reads this step's slot t - 1
        return states


def start_from_head(directory, target, taps: tuple[int, ...] | None) -> tuple[HeadConfig, dict]:
    """A head's config and float32 tensors to continue training from, read from the
    EAGLE-3 checkpoint in `directory` and checked against the native `target` (and `taps`, when
    a recipe names them): its rows stay its own, its taps decide the features."""
    from ..backends.head import is_head, load_head

    if not is_head(directory):
        raise ValueError(f"init_from: {str(directory)!r} holds no EAGLE-3 head (config.json naming it)")
    cfg, weights = load_head(directory, target.shape.layers)
    s = target.shape
    if (cfg.vocab_size, cfg.hidden_size, cfg.target_hidden_size) != (s.vocab, s.hidden, s.hidden):
        raise ValueError(
            f"init_from: the head reads {cfg.target_hidden_size}-wide features of a {cfg.vocab_size}-token "
            f"vocabulary at width {cfg.hidden_size}; the target is {s.hidden} wide over {s.vocab} tokens"
        )
    if taps is not None and tuple(taps) != cfg.taps:
        raise ValueError(
            f"init_from: the head reads layers {list(cfg.taps)}, the recipe's taps are {list(taps)}"
        )
    if "embed_tokens.weight" in weights:
        raise ValueError(
            "init_from: a head with an embedding of its own is not trained here (it reads the target's)"
        )
    return cfg, {k: v.float() if v.is_floating_point() else v for k, v in weights.items()}


def init_head(target, taps, vocab_ids: list[int], intermediate_size: int | None = None, seed: int = 0):
    """A head config and starting tensors for the native `target`: its LM head the target's
    output rows `vocab_ids`, its final norm the target's, fc passing the last tap through, the
    layer's products small and random."""
    s = target.shape
    H, K = s.hidden, len(vocab_ids)
    cfg = HeadConfig(
        hidden_size=H,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        intermediate_size=intermediate_size or s.intermediate,
        vocab_size=s.vocab,
        draft_vocab_size=K,
        target_hidden_size=H,
        taps=tuple(taps),
        rms_norm_eps=s.eps,
        rope_theta=float(s.rope["rope_theta"]),
        max_position_embeddings=s.max_positions or 2048,
    )
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(sorted(vocab_ids))
    weights = {}
    for name, shape in head_weight_shapes(cfg).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        elif name not in ("d2t", "t2d"):
            weights[name] = 0.02 * torch.randn(shape, generator=g)
    fc = torch.zeros(H, len(taps) * H)
    fc[:, -H:] = torch.eye(H)  # the last tap passes through
    weights["fc.weight"] = fc
    weights["norm.weight"] = target.norm.detach().float().clone()
    head_rows = target.embed if s.tied else target.lm_head.weight
    weights["lm_head.weight"] = head_rows[ids].detach().float().clone()
    weights["d2t"] = ids - torch.arange(K)
    weights["t2d"] = torch.zeros(s.vocab, dtype=torch.bool)
    weights["t2d"][ids] = True
    return cfg, weights


# ---- batches and the loss -----------------------------------------------------------------------
@dataclass
class HeadBatch:
    features: torch.Tensor  # [B, L, F] slot t: the target's features at position t
    tokens: torch.Tensor  # [B, L] slot t: token t + 1
    where: tuple[torch.Tensor, torch.Tensor]  # ([M] sequence, [M] slot): slots with a target
    rows: torch.Tensor  # [M, k] draft rows of the target's top-k at token t + 2 (-1: not a row)
    probs: torch.Tensor  # [M, k] their stored probabilities (the tail is 1 - their sum)


def head_batch(data: Dataset, features, seqs, rows_mask: np.ndarray, row_of: torch.Tensor) -> HeadBatch:
    """Sequences `seqs` as head slots: slot t of a sequence of n tokens reads (f_t, x_{t+1}),
    t < n - 1, and learns the stored distribution of x_{t+2} where `rows_mask` keeps its row."""
    lengths = [int(data.offsets[s + 1] - data.offsets[s]) - 1 for s in seqs]  # slots per sequence
    B, L = len(seqs), max(lengths)
    feats = None
    tokens = torch.zeros(B, L, dtype=torch.long)
    which, slot, rows = [], [], []
    for b, (s, n) in enumerate(zip(seqs, lengths)):
        a = int(data.offsets[s])
        f = features[a : a + n]
        if feats is None:
            feats = torch.zeros(B, L, f.shape[1], dtype=f.dtype)
        feats[b, :n] = f
        tokens[b, :n] = torch.from_numpy(data.tokens[a + 1 : a + 1 + n].astype(np.int64))
        first = a - s  # the sequence's first stored row: the distribution of token 1
        ts = np.arange(n - 1)  # slot t's target is row first + t + 1 (token t + 2)
        ts = ts[rows_mask[first + 1 + ts]]
        which.append(np.full(len(ts), b))
        slot.append(ts)
        rows.append(first + 1 + ts)
    rows = np.concatenate(rows)
    ids = torch.from_numpy(data.topk_ids[rows].astype(np.int64))
    probs = torch.from_numpy(data.topk_probs[rows].astype(np.float32))
    where = (torch.from_numpy(np.concatenate(which)), torch.from_numpy(np.concatenate(slot)))
    return HeadBatch(feats, tokens, where, row_of[ids.clamp_min(0)].masked_fill(ids < 0, -1), probs)


def head_loss(model: HeadModel, batch: HeadBatch, unroll: int) -> tuple[torch.Tensor, list[float]]:
    """Sum over steps j of DECAY^j x the forward KL of the head's q from the target's stored
    distribution (its top-k over the head's rows and the rest, `losses.buckets`), at slots
    t >= j; and each step's top-1 agreement."""
    states = model.states(batch.features, batch.tokens, unroll)
    b, t = batch.where
    total, agree = 0.0, []
    for j, out in enumerate(states):
        keep = t >= j
        logq = torch.log_softmax(model.logits(out[b[keep], t[keep]]).float(), -1)  # [M_j, K]
        rows = batch.rows[keep]
        P, Q, logQ = buckets(logq, rows, batch.probs[keep], rows >= 0)
        total = total + DECAY**j * divergence("kl", P, Q, logQ).mean()
        best = rows.gather(1, batch.probs[keep].argmax(-1, keepdim=True))[:, 0]
        agree.append(float((logq.argmax(-1) == best).float().mean()))
    return total, agree


@torch.no_grad()
def head_proxy(model: HeadModel, data: Dataset, features, row_of: torch.Tensor, batch_size: int = 8) -> dict:
    """{"alpha": mean sum over the stored top-k of min(p, q), "top1": argmax agreement} of the
    head's first step on `data`'s response rows (no target forward: the stored distributions)."""
    rows_mask = data.response_rows()
    alpha, top1, n = 0.0, 0.0, 0
    for start in range(0, len(data), batch_size):
        batch = head_batch(
            data, features, list(range(start, min(len(data), start + batch_size))), rows_mask, row_of
        )
        b, t = batch.where
        first = model.states(batch.features, batch.tokens, 0)[0]  # [B, L, H]
        logq = torch.log_softmax(model.logits(first[b, t]).float(), -1)
        P, Q, _ = buckets(logq, batch.rows, batch.probs, batch.rows >= 0)
        alpha += float(alpha_lower_bound(P, Q).sum())
        top1 += float((logq.argmax(-1) == batch.rows[:, 0]).sum())
        n += len(P)
    return {"alpha": round(alpha / n, 4), "top1": round(top1 / n, 4)}


# ---- the run ----------------------------------------------------------------------------------
def distill_head(
    target, out_dir, data_from, minutes: float | None = None, resume: bool = False, **recipe
) -> Path:
    """Train a feature head for `target` (GGUF file, directory or hub id) on the data of finished
    `treespec distill` runs (`data_from`: their output directories, e.g. `--data-only` runs),
    for `minutes` of training (or `steps`, or `epochs`), evaluated on the first run's held-out
    prompts. Writes an EAGLE-3 checkpoint, head.json and eval.jsonl to `out_dir`; `resume`
    continues an interrupted run there. `recipe`: `HeadRecipe` fields."""
    if minutes is not None and (
        isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or minutes <= 0
    ):
        raise ValueError(f"minutes must be a number > 0 (or None: steps or epochs decide), got {minutes!r}")
    rec = HeadRecipe.from_kwargs(recipe)
    runs = [Path(d) for d in ([data_from] if isinstance(data_from, (str, Path)) else data_from)]
    for run in runs:
        meta = run / "work" / "data" / "meta.json"
        if not meta.is_file() or not json.loads(meta.read_text()).get("complete"):
            raise ValueError(f"data_from: {run} holds no finished distill data (make it with --data-only)")
    out = Path(out_dir)
    work = out / "work"
    record = {
        "target": str(target),
        "data_from": [str(r) for r in runs],
        "minutes": minutes,
        "recipe": rec.as_dict(),
    }
    if resume:
        if not (work / "run.json").is_file():
            raise ValueError(f"nothing to resume in {out}: no work/run.json (start without resume)")
        stored = json.loads((work / "run.json").read_text())
        differ = [k for k in ("target", "data_from", "minutes") if stored[k] != record[k]]
        differ += [
            k for k, v in record["recipe"].items() if k not in HeadRecipe.MACHINE and stored["recipe"][k] != v
        ]
        if differ:
            raise ValueError(f"resume cannot change {', '.join(differ)} (start a new run instead)")
    elif out.exists() and any(out.iterdir()):
        raise ValueError(f"the output directory {str(out)!r} is not empty; pass resume=True or use a new one")
    work.mkdir(parents=True, exist_ok=True)
    (work / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    return _HeadRun(target, out, runs, minutes, rec).execute()


class _HeadRun:
    def __init__(self, target, out: Path, runs: list[Path], minutes, rec: HeadRecipe):
        self.target, self.out, self.runs, self.minutes, self.rec = target, out, runs, minutes, rec
        self.work = out / "work"
        self.eval_path = out / "eval.jsonl"

    def execute(self) -> Path:
        from .. import loading
        from ..backends import bf16_kernels_enabled
        from ..backends.head import save_head
        from .pipeline import choose_subset

        rec, t_start = self.rec, time.time()
        if rec.threads is not None:
            torch.set_num_threads(rec.threads)
        run_data = []
        for run in self.runs:
            meta = json.loads((run / "work" / "data" / "meta.json").read_text())
            data_dir = run / "work" / "data"
            run_data.append(
                [load_shard(data_dir / f"shard_{i:05d}.safetensors") for i in range(meta["shards"])]
            )
        data = Dataset([shard for shards in run_data for shard in shards])
        held = Dataset([load_shard(self.runs[0] / "work" / "data" / "heldout.safetensors")])
        device = loading.resolve_device(None)
        self.target_runner = loading.load_runner(
            self.target, loading.resolve_dtype(rec.dtype, device, "target"), device, "native"
        )
        self.tokenizer = loading.load_tokenizer(self.target)
        s = self.target_runner.shape
        if rec.init_from is None:
            vocab_ids = choose_subset(
                data.token_mass(s.vocab), rec.vocab_subset, sorted(self.target_runner.eos_token_ids)
            )
            taps = default_taps(s.layers) if rec.taps is None else rec.taps
            cfg, weights = init_head(self.target_runner, taps, vocab_ids, seed=rec.seed)
        else:
            cfg, weights = start_from_head(rec.init_from, self.target_runner, rec.taps)
        taps = cfg.taps
        if max(taps) > s.layers:
            raise ValueError(f"taps {list(taps)} name layers beyond the target's {s.layers}")
        parts = [self._features(run, Dataset(shards), taps) for run, shards in zip(self.runs, run_data)]
        features, feature_seconds = FeatureSet([f for f, _ in parts]), round(sum(t for _, t in parts), 1)
        held_features = FeaturesInMemory(len(held.tokens), len(taps) * s.hidden)
        compute_features(self.target_runner, held, taps, held_features)
        model = HeadModel(cfg, self.target_runner.embed.detach(), weights)
        if rec.freeze_lm_head:
            model.w("lm_head.weight").requires_grad_(False)
        row_of = model.row_of(s.vocab)
        self.eval_ids = held.prompts()[: rec.eval_prompts]
        rows_mask = data.row_mask(train_on_prompt=False)
        bf16 = bf16_kernels_enabled()  # AVX512-BF16 / AMX: the products under bf16 autocast

        def loss(seqs):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                return head_loss(model, head_batch(data, features, seqs, rows_mask, row_of), rec.unroll)[0]

        def evaluate(m, step, mean_loss):
            return self._evaluate(m, cfg, held, held_features, row_of, step, mean_loss)

        clock = Clock.load(self.work / "clock.json", None if self.minutes is None else self.minutes * 60)
        self._prune_eval_log()
        job = Job(
            n_sequences=len(data), recipe=rec, loss=loss, index=0, checkpoint=self.work / "head.pt",
            clock=clock, until=clock.budget, evaluate=evaluate, progress=self._bar if rec.progress else None,
            name="head",
        )  # fmt: skip
        summary = train_model(model, job)
        save_head(
            self.out,
            cfg,
            {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.state().items()},
        )
        if rec.acceptance:
            self._write_acceptance()
        head = {
            "target": str(self.target),
            "data_from": [str(r) for r in self.runs],
            "recipe": {**rec.as_dict(), "taps": list(taps), "bf16_autocast": bf16},
            "data": {
                "sequences": len(data),
                "tokens": len(data.tokens),
                "response_positions": int(data.response_rows().sum()),
                "feature_seconds": feature_seconds,
            },
            **summary,
            "total_seconds": round(time.time() - t_start, 1),
            "curve": read_jsonl(self.eval_path),
        }
        (self.out / "head.json").write_text(json.dumps(head, indent=1) + "\n")
        return self.out

    def _features(self, run: Path, data: Dataset, taps) -> tuple[Features, float]:
        """A data run's features, computed (or continued) once and kept beside its shards
        (`features_<taps>_<dtype>.npy`): every head trained on the run with these taps reads them."""
        name = f"features_{'-'.join(map(str, taps))}_{self.rec.dtype}"
        path, state_path = run / "work" / "data" / f"{name}.npy", run / "work" / "data" / f"{name}.json"
        width = len(taps) * self.target_runner.shape.hidden
        state = json.loads(state_path.read_text()) if state_path.is_file() else None
        if state is None or state["tokens"] != len(data.tokens) or not path.is_file():
            state = {"taps": list(taps), "tokens": len(data.tokens), "done": 0, "seconds": 0.0}
            store = Features(path, (len(data.tokens), width))
        else:
            store = Features(path)
        if state["done"] < len(data):
            bar = (
                self._bar(total=len(data), initial=state["done"], desc=f"features of {run.name}", unit="seq")
                if self.rec.progress
                else None
            )
            t0 = time.time()

            def on_chunk(done: int) -> None:  # flushed, then recorded: a cut run resumes here
                nonlocal t0
                store.flush()
                state.update(done=done, seconds=round(state["seconds"] + time.time() - t0, 1))
                t0 = time.time()
                state_path.write_text(json.dumps(state) + "\n")
                if bar is not None:
                    bar.update(done - bar.n)

            compute_features(self.target_runner, data, taps, store, state["done"], on_chunk)
            if bar is not None:
                bar.close()
        return store, state["seconds"]

    def _evaluate(self, model, cfg, held, held_features, row_of, step: int, mean_loss) -> dict:
        from ..backends.head import HeadRunner
        from .evaluate import acceptance

        t0 = time.time()
        model.eval()
        head = HeadRunner(cfg, model.state(), self.target_runner.embed.detach(), dtype=torch.float32)
        record = {
            "step": step,
            "loss": None if mean_loss is None else round(mean_loss, 4),
            "proxy": head_proxy(model, held, held_features, row_of),
            **acceptance(self.target_runner, self.tokenizer, head, self.eval_ids, self.rec.eval_tokens),
        }
        model.train()
        record["eval_seconds"] = round(time.time() - t0, 2)
        with self.eval_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.rec.progress:
            a0, a1 = record["T0"]["acceptance_by_depth"], record["T1"]["acceptance_by_depth"]
            print(
                f"head step {step}: acceptance by depth T=0 {a0}, T=1 {a1}; proxy {record['proxy']}",
                flush=True,
            )
        return record

    def _write_acceptance(self) -> None:
        """The saved head's positional acceptance on the held-out prompts, beside it
        (acceptance.json: what the automatic tree plans with)."""
        from ..autotree import write_acceptance
        from ..backends.head import load_head_runner
        from ..decoder import SpeculativeDecoder

        target = self.target_runner
        head = load_head_runner(self.out, target, target.dtype, target.device)
        write_acceptance(
            SpeculativeDecoder(target, head, self.tokenizer), self.eval_ids, self.out, self.rec.eval_tokens
        )

    def _prune_eval_log(self) -> None:
        """Drop evaluations a resumed run will redo: past the last checkpoint."""
        rows = read_jsonl(self.eval_path)
        if rows:
            path = self.work / "head.pt"
            last = torch.load(path, weights_only=False)["step"] if path.is_file() else -1
            self.eval_path.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= last))

    @staticmethod
    def _bar(**kwargs):
        from tqdm.auto import tqdm

        return tqdm(**kwargs)
