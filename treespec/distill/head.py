"""Training a feature head (EAGLE-3) for a target, on `treespec distill`'s on-policy data.

    features   one teacher-forced pass of the target over every stored sequence, its taps kept
               (the inputs of layers {2, N/2, N-3}, bf16): the only target forwards of training
    train      the head reads (f_t, token t+1) and learns the target's distribution of token t+2
               (the stored top-k, restricted to the head's rows), then again on its OWN output
               states for `unroll` more steps (EAGLE-3's training-time test): step j's slot t
               reads step j-1's state at slot t-1 and attends to the target-fed slots <= t-j and
               its own chain of unrolled slots, exactly what a node j levels below the root sees
               when drafting. Step j's loss weighs 0.8^j.
    save       an EAGLE-3 checkpoint (`treespec.backends.head.save_head`)

The head starts as a copy of the target's last stage: its LM head is the target's output rows
of the draft vocabulary, its final norm the target's, and fc passes the last tap through, so
at step 0 it already predicts what the target's late features say.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..backends.base import prefill_many
from ..backends.head import HeadConfig, default_taps, head_weight_shapes
from .data import Dataset, load_shard

DECAY = 0.8  # EAGLE-3: step j of the unrolled test weighs DECAY ** j


def target_features(target, data: Dataset, taps, max_tokens: int = 4096) -> torch.Tensor:
    """The target's tapped features at every stored token, [T, len(taps) * H] bf16, aligned with
    `data.tokens`: sequences prefilled as packed lanes of a native runner, `max_tokens` a forward."""
    target.set_taps(taps)
    seqs = data.sequences()
    out = []
    i = 0
    while i < len(seqs):
        n, total = 0, 0
        while i + n < len(seqs) and (n == 0 or total + len(seqs[i + n]) <= max_tokens):
            total += len(seqs[i + n])
            n += 1
        lanes = target.lanes(n)
        scores = prefill_many([(lane, seq.tolist()) for lane, seq in zip(lanes, seqs[i : i + n])])
        out.extend(s.features.to(torch.bfloat16) for s in scores)
        i += n
    target.set_taps(())
    return torch.cat(out)


class HeadModel(torch.nn.Module):
    """The head's weights as trainable parameters (EAGLE-3 names), the target's embedding frozen."""

    def __init__(self, cfg: HeadConfig, embed: torch.Tensor, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("embed", embed.float())
        self.register_buffer("ids", torch.arange(cfg.draft_vocab_size) + weights["d2t"].long())
        self.names = [n for n in weights if n not in ("d2t", "t2d")]
        self.params = torch.nn.ParameterDict(
            {n.replace(".", "__"): torch.nn.Parameter(weights[n].float().clone()) for n in self.names}
        )
        self.t2d = weights["t2d"]

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
        cfg = self.cfg
        B, L = tokens.shape
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        g = Hq // Hkv
        cos, sin = self._rope(L, tokens.device)
        cos, sin = cos[None, None], sin[None, None]  # [1, 1, L, D]: slot t sits at position t
        e = self._norm(F.embedding(tokens, self.embed), "midlayer.input_layernorm.weight")  # [B, L, H]
        h = features.float() @ self.w("fc.weight").T  # [B, L, H]
        a_, m_ = "midlayer.self_attn.", "midlayer.mlp."
        keys, values, logits = [], [], []
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
            logits.append(self._norm(out, "norm.weight") @ self.w("lm_head.weight").T)  # [B, L, K]
            h = torch.roll(out, 1, dims=1)  # the next step's slot t reads this step's slot t - 1
        return logits


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


@dataclass
class HeadBatch:
    features: torch.Tensor  # [B, L, F] slot t: the target's features at position t
    tokens: torch.Tensor  # [B, L] slot t: token t + 1
    where: tuple[torch.Tensor, torch.Tensor]  # ([M] sequence, [M] slot): slots with a target
    rows: torch.Tensor  # [M, k] draft rows of the target's top-k at token t + 2 (-1: not a row)
    probs: torch.Tensor  # [M, k] their probabilities, renormalised over the draft rows


def head_batch(data: Dataset, features: torch.Tensor, seqs, rows_mask: np.ndarray, row_of: torch.Tensor):
    """Sequences `seqs` as head slots: slot t of a sequence of n tokens reads (f_t, x_{t+1}),
    t < n - 1, and learns the stored distribution of x_{t+2} where `rows_mask` keeps its row."""
    lengths = [int(data.offsets[s + 1] - data.offsets[s]) - 1 for s in seqs]  # slots per sequence
    B, L = len(seqs), max(lengths)
    feats = torch.zeros(B, L, features.shape[1], dtype=features.dtype)
    tokens = torch.zeros(B, L, dtype=torch.long)
    which, slot, rows = [], [], []
    for b, (s, n) in enumerate(zip(seqs, lengths)):
        a = int(data.offsets[s])
        feats[b, :n] = features[a : a + n]
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
    draft_rows = row_of[ids]  # [M, k]
    probs = torch.where(draft_rows >= 0, probs, 0.0)
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-9)
    where = (torch.from_numpy(np.concatenate(which)), torch.from_numpy(np.concatenate(slot)))
    return HeadBatch(feats, tokens, where, draft_rows, probs)


def head_loss(model: HeadModel, batch: HeadBatch, unroll: int) -> tuple[torch.Tensor, list[float]]:
    """Sum over steps j of DECAY^j x the cross-entropy of the head's q against the target's
    stored distribution (over the draft rows), at slots t >= j; and each step's top-1 agreement."""
    logits = model(batch.features, batch.tokens, unroll)
    b, t = batch.where
    rows = batch.rows.clamp_min(0)
    total, agree = 0.0, []
    for j, lg in enumerate(logits):
        keep = t >= j
        sel = lg[b[keep], t[keep]].float()  # [M_j, K]
        logq = sel.gather(1, rows[keep]) - torch.logsumexp(sel, -1, keepdim=True)  # [M_j, k]
        ce = -(batch.probs[keep] * logq).sum(-1).mean()
        total = total + DECAY**j * ce
        best = batch.rows[keep].gather(1, batch.probs[keep].argmax(-1, keepdim=True))[:, 0]
        agree.append(float((sel.argmax(-1) == best).float().mean()))
    return total, agree


def train_head(
    model: HeadModel,
    data: Dataset,
    features: torch.Tensor,
    row_of: torch.Tensor,
    unroll: int,
    seconds: float,
    batch_size: int = 8,
    lr: float = 1e-3,
    seed: int = 0,
    log=None,
    bf16: bool = False,
) -> dict:
    """AdamW on the response slots for `seconds` of wall time (cosine schedule over that
    budget, by elapsed time); `log(step, loss, agree)` now and then. `bf16`: products under
    bf16 autocast (fp32 master weights; 2.4x faster a step where the CPU has AMX)."""
    rows_mask = data.row_mask(train_on_prompt=False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    rng = np.random.default_rng(seed)
    order, step, t0 = [], 0, time.time()
    losses = []
    while time.time() - t0 < seconds:
        if len(order) < batch_size:
            order = list(rng.permutation(len(data))) + order
        seqs, order = order[:batch_size], order[batch_size:]
        frac = min(1.0, (time.time() - t0) / seconds)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, agree = head_loss(model, head_batch(data, features, seqs, rows_mask, row_of), unroll)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        step += 1
        if log is not None and step % 25 == 0:
            log(step, float(np.mean(losses[-25:])), agree)
    return {"steps": step, "seconds": round(time.time() - t0, 1), "final_loss": float(np.mean(losses[-25:]))}


def distill_head(
    target,
    out_dir,
    data_from,
    minutes: float,
    unroll: int = 2,
    taps=None,
    vocab_subset: int = 8192,
    batch_size: int = 8,
    lr: float = 1e-3,
    evals: int = 4,
    eval_prompts: int = 16,
    eval_tokens: int = 48,
    dtype: str = "bfloat16",
    seed: int = 0,
    progress: bool = True,
):
    """Train a head for `target` (GGUF file, directory or hub id) on the data of finished
    `treespec distill --data-only` runs (`data_from`: their output directories), for `minutes`
    of training split into `evals` parts, each followed by a held-out acceptance measurement
    (the first run's held-out prompts, `eval_prompts` of them, `eval_tokens` each).
    Writes an EAGLE-3 checkpoint and head.json (recipe, data size, times, the curve) to `out_dir`."""
    from .. import loading
    from ..backends import bf16_kernels_enabled
    from ..backends.head import HeadRunner, save_head
    from .evaluate import acceptance
    from .pipeline import choose_subset

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    runs = [Path(d) for d in ([data_from] if isinstance(data_from, (str, Path)) else data_from)]
    shards = []
    for run in runs:
        meta = json.loads((run / "work" / "data" / "meta.json").read_text())
        shards += [
            load_shard(run / "work" / "data" / f"shard_{i:05d}.safetensors") for i in range(meta["shards"])
        ]
    data = Dataset(shards)
    device = loading.resolve_device(None)
    target_runner = loading.load_runner(
        target, loading.resolve_dtype(dtype, device, "target"), device, "native"
    )
    tokenizer = loading.load_tokenizer(target)
    s = target_runner.shape
    taps = default_taps(s.layers) if taps is None else tuple(taps)
    t0 = time.time()
    features = target_features(target_runner, data, taps)
    feature_seconds = time.time() - t0
    mass = data.token_mass(s.vocab)
    vocab_ids = choose_subset(mass, vocab_subset, sorted(target_runner.eos_token_ids))
    cfg, weights = init_head(target_runner, taps, vocab_ids, seed=seed)
    model = HeadModel(cfg, target_runner.embed.detach(), weights)
    row_of = torch.full((s.vocab,), -1, dtype=torch.long)
    row_of[torch.tensor(vocab_ids)] = torch.arange(len(vocab_ids))
    held = Dataset([load_shard(runs[0] / "work" / "data" / "heldout.safetensors")]).prompts()[:eval_prompts]
    curve, steps, log_lines = [], 0, []

    def evaluate(step: int) -> dict:
        head = HeadRunner(cfg, model.state(), target_runner.embed.detach(), dtype=torch.float32)
        acc = acceptance(target_runner, tokenizer, head, held, eval_tokens)
        point = {"step": step, "seconds": round(time.time() - t_start, 1), **acc}
        curve.append(point)
        if progress:
            print(
                f"step {step}: T=0 {acc['T0']['acceptance_by_depth']} tau {acc['T0']['tokens_per_step']}; "
                f"T=1 {acc['T1']['acceptance_by_depth']} tau {acc['T1']['tokens_per_step']}",
                flush=True,
            )
        return point

    def log(step, loss, agree):
        line = f"step {steps + step}: loss {loss:.3f}, top-1 agreement by step {[round(a, 3) for a in agree]}"
        log_lines.append(line)
        if progress:
            print(line, flush=True)

    bf16 = bf16_kernels_enabled()  # AMX / AVX512-BF16: train under bf16 autocast
    evaluate(0)
    train_seconds = 0.0
    for part in range(evals):
        info = train_head(
            model, data, features, row_of, unroll, minutes * 60 / evals, batch_size, lr, seed + part, log
        )
        steps += info["steps"]
        train_seconds += info["seconds"]
        evaluate(steps)
    save_head(
        out, cfg, {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.state().items()}
    )
    summary = {
        "target": str(target),
        "data_from": [str(r) for r in runs],
        "recipe": {
            "taps": list(taps),
            "unroll": unroll,
            "vocab_subset": vocab_subset,
            "batch_size": batch_size,
            "lr": lr,
            "minutes": minutes,
            "dtype": dtype,
            "bf16_autocast": bf16,
            "seed": seed,
        },
        "data": {
            "sequences": len(data),
            "response_positions": int(data.response_rows().sum()),
            "feature_seconds": round(feature_seconds, 1),
        },
        "steps": steps,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.time() - t_start, 1),
        "params": sum(p.numel() for p in model.parameters()),
        "curve": curve,
    }
    (out / "head.json").write_text(json.dumps(summary, indent=1) + "\n")
    return out
