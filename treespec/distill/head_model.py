"""A feature head (EAGLE-3) as a trainable model, and its loss on the target's stored
distributions.

    HeadModel                    the head's weights as parameters; its unrolled forward (EAGLE-3's
                                 training-time test: step j reads step j-1's output states)
    init_head / start_from_head  its starting tensors: from the target's last stage, or from an
                                 EAGLE-3 checkpoint
    head_batch / head_loss       slots of stored sequences, and the decayed forward KL over steps
    head_proxy                   acceptance proxies on stored distributions (no target forward)

`treespec.backends.head.HeadRunner` runs the same weights for drafting (`HeadModel.state()` is
its checkpoint); `treespec.distill.head` trains them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..backends.head import HeadConfig, head_weight_shapes
from .data import Dataset
from .losses import alpha_lower_bound, buckets, divergence

DECAY = 0.8  # EAGLE-3: step j of the unrolled test weighs DECAY ** j


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
