#!/usr/bin/env python
"""Train the bundled ``pycode`` target/draft pair on the Python standard library.

One command (CPU only, no network; about 100 minutes of wall time by default)::

    python experiments/build/train_pycode_pair.py --threads 2

It writes ``treespec/zoo/pycode/{target,draft}/`` (Hugging Face format, bf16
``model.safetensors``, ``config.json``, ``generation_config.json`` and the shared
tokenizer files in both dirs), ``treespec/zoo/pycode/training_log.json`` and
``treespec/zoo/pycode/heldout_prompts.json``.  Intermediate state (tokenizer, token
caches, resumable checkpoints) lives in ``experiments/.cache/`` (git-ignored).
Interrupted?  Re-run the same command with ``--resume``: finished stages are
skipped, an unfinished stage continues from its last checkpoint (its remaining
time budget is kept).

Smoke test (tiny models, seconds per stage, writes into a scratch dir)::

    python experiments/build/train_pycode_pair.py --tiny --threads 1 \
        --out /tmp/pycode_smoke --prompts-out /tmp/pycode_smoke/heldout_prompts.json

Data
    Every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` except those under
    ``site-packages`` and test directories (any path component named ``test``,
    ``tests`` or ``idle_test``), files that are not valid UTF-8 and files larger than
    400 kB.  The split is by file: a file is held out iff
    ``int(sha1(relpath)[:8], 16) % 1000 < 20`` (about 2 % of files); held-out files
    are never seen by the tokenizer trainer or the models.  The held-out prompts are
    line-aligned snippets (file heads and ``def``/``class`` headers with their
    docstrings, <= 200 tokens) taken from held-out files.

Tokenizer
    Byte-level BPE (HF ``tokenizers``), vocab 8192, specials ``<|endoftext|>`` (id 0:
    EOS, BOS and document separator) and ``<|pad|>`` (id 1).  Lossless:
    ``decode(encode(x)) == x`` is checked on every held-out file.

Models
    ``LlamaForCausalLM`` with GQA, RoPE, tied embeddings, context 512.
    Target: hidden 512, 8 layers, 8 heads / 2 KV heads, MLP 1376 (~26.4M params).
    Draft: hidden 128, 2 layers, 4 heads / 2 KV heads, MLP 384 (~1.4M params).
    The target is trained first with next-token cross-entropy; the draft is then
    distilled from it (``kl_weight * KL(p_target || q_draft) + (1 - kl_weight) * CE``).

Training
    AdamW (betas 0.9/0.95, wd 0.1), linear warmup then cosine decay to 10 % of the
    peak LR, driven by the fraction of the stage's wall-clock budget used
    (``--target-minutes``/``--draft-minutes``), grad clip 1.0, random windows of
    ``seq_len + 1`` tokens from the packed ``<|endoftext|>``-separated training
    stream.  Mixed precision: ``--amp auto`` uses bf16 autocast only when the CPU has
    AMX (fast bf16 matmuls); on CPUs without it (like the machine this was first
    trained on, where bf16 matmuls were 4x slower than fp32) it trains in fp32.

At the end it reports held-out loss/perplexity, per-token decode latency at batch 1
(KV cache, 128-token prefix) for both models, and the greedy agreement of the pair:
the rate at which the draft's argmax equals the target's argmax along the target's
greedy continuations of held-out prompts (see ``greedy_agreement``; it can also be
run alone with ``--eval-only``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
EOS = "<|endoftext|>"
PAD = "<|pad|>"
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test"}
MAX_FILE_BYTES = 400_000
HELDOUT_PER_MILLE = 20
PROMPT_MAX_TOKENS = 200
N_PROMPTS = 64

TARGET_CFG = dict(
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1376
)
DRAFT_CFG = dict(
    hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=384
)
TINY_TARGET_CFG = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128
)
TINY_DRAFT_CFG = dict(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64
)


def log(*a):
    print(time.strftime("[%H:%M:%S]"), *a, flush=True)


# ----------------------------------------------------------------------------- data
def collect_files():
    root = Path(sysconfig.get_paths()["stdlib"])
    train, heldout, skipped = [], [], 0
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if any(part in SKIP_DIRS for part in p.relative_to(root).parts[:-1]):
            continue
        try:
            if p.stat().st_size > MAX_FILE_BYTES:
                skipped += 1
                continue
            text = p.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            skipped += 1
            continue
        if not text.strip():
            continue
        h = int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 1000
        (heldout if h < HELDOUT_PER_MILLE else train).append((rel, text))
    return root, train, heldout, skipped


def train_tokenizer(texts, vocab_size):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def hf_tokenizer(tok_json: Path):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(tok_json),
        eos_token=EOS,
        bos_token=EOS,
        pad_token=PAD,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def encode_stream(tok, texts, eos_id):
    """<|endoftext|> doc <|endoftext|> doc ... as one uint16 array."""
    encs = tok.encode_batch(texts)
    parts = []
    for e in encs:
        parts.append(np.array([eos_id], dtype=np.uint16))
        parts.append(np.asarray(e.ids, dtype=np.uint16))
    return np.concatenate(parts)


def make_prompts(tok, heldout, n=N_PROMPTS):
    """Line-aligned prompts: each held-out file's head, then def/class headers."""
    per_file = []
    for rel, text in heldout:
        lines = text.splitlines(keepends=True)
        cands = []
        starts = [0] + [i for i, ln in enumerate(lines) if ln.lstrip().startswith(("def ", "class "))]
        for s in starts:
            acc, ntok = "", 0
            for j in range(s, min(len(lines), s + (30 if s == 0 else 25))):
                t = len(tok.encode(lines[j]).ids)
                if ntok + t > PROMPT_MAX_TOKENS:
                    break
                acc += lines[j]
                ntok += t
                # stop after the docstring of a def/class (or after 12 lines without one)
                if (
                    s
                    and j > s
                    and (
                        lines[j].rstrip().endswith(('"""', "'''"))
                        and j > s + 1
                        or j - s >= 12
                        and '"""' not in acc
                    )
                ):
                    break
            if ntok >= 8 and acc.strip():
                cands.append({"file": rel, "line": s + 1, "n_tokens": ntok, "text": acc})
        if cands:
            per_file.append(cands)
    # round-robin over files (deterministic), spread over each file's candidates
    out, k = [], 0
    while len(out) < n and any(per_file):
        for cands in per_file:
            if k < len(cands) and len(out) < n:
                idx = (k * 7919) % len(cands) if k else 0
                c = cands[idx]
                if c not in out:
                    out.append(c)
        k += 1
        if k > 1000:
            break
    return out


def prepare_data(args):
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    root, train, heldout, skipped = collect_files()
    log(f"stdlib {root}: {len(train)} train files, {len(heldout)} held-out files, {skipped} skipped")
    tok_dir = cache / f"tokenizer_v{args.vocab}"
    tok_json = tok_dir / "tokenizer.json"
    if not tok_json.exists():
        from tokenizers import Tokenizer  # noqa: F401

        t0 = time.time()
        tok = train_tokenizer([t for _, t in train], args.vocab)
        tok_dir.mkdir(parents=True, exist_ok=True)
        tok.save(str(tok_json))
        log(f"trained tokenizer (vocab {tok.get_vocab_size()}) in {time.time() - t0:.0f}s")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_json))
    eos_id, pad_id = tok.token_to_id(EOS), tok.token_to_id(PAD)
    # lossless round trip on every held-out file and a sample of training files
    for rel, text in heldout + train[::50]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text, rel
    hf = hf_tokenizer(tok_json)
    hf.save_pretrained(str(tok_dir))
    # portable class name (transformers 4.x and 5.x both resolve it offline)
    tc = tok_dir / "tokenizer_config.json"
    tcd = json.loads(tc.read_text())
    tcd["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc.write_text(json.dumps(tcd, indent=2) + "\n")
    for rel, text in heldout[:3]:
        assert hf.decode(hf(text)["input_ids"]) == text, rel
    stream_path = cache / f"tokens_v{args.vocab}.npz"
    if not stream_path.exists():
        tr = encode_stream(tok, [t for _, t in train], eos_id)
        ho = encode_stream(tok, [t for _, t in heldout], eos_id)
        np.savez(stream_path, train=tr, heldout=ho)
    z = np.load(stream_path)
    tr, ho = z["train"], z["heldout"]
    chars = sum(len(t) for _, t in train) / len(tr)
    log(f"tokens: train {len(tr):,}  held-out {len(ho):,}  ({chars:.2f} chars/token)")
    prompts = make_prompts(tok, heldout)
    pj = {
        "description": "Held-out prompts for the bundled pycode pair: line-aligned snippets of "
        "Python stdlib files that were never used to train the tokenizer or models.",
        "split": f"file held out iff int(sha1(relpath)[:8],16) % 1000 < {HELDOUT_PER_MILLE}; "
        f"relpaths relative to the stdlib dir; test dirs and site-packages excluded",
        "python": sys.version.split()[0],
        "heldout_files": [r for r, _ in heldout],
        "prompts": prompts,
    }
    Path(args.prompts_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.prompts_out).write_text(json.dumps(pj, indent=1) + "\n")
    log(f"wrote {len(prompts)} prompts from {len(heldout)} held-out files to {args.prompts_out}")
    info = dict(
        stdlib=str(root),
        python=sys.version.split()[0],
        train_files=len(train),
        heldout_files=len(heldout),
        skipped_files=skipped,
        train_tokens=int(len(tr)),
        heldout_tokens=int(len(ho)),
        train_chars=sum(len(t) for _, t in train),
        heldout_chars=sum(len(t) for _, t in heldout),
        vocab_size=tok.get_vocab_size(),
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        n_prompts=len(prompts),
    )
    return tok_dir, tr, ho, prompts, info


# ----------------------------------------------------------------------------- models
def make_model(cfg, info, seq_len, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    c = LlamaConfig(
        vocab_size=info["vocab_size"],
        max_position_embeddings=seq_len,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        bos_token_id=info["eos_token_id"],
        eos_token_id=info["eos_token_id"],
        pad_token_id=info["pad_token_id"],
        initializer_range=0.02,
        **cfg,
    )
    return LlamaForCausalLM(c)


def n_params(m):
    return sum(p.numel() for p in m.parameters())


def amp_ctx(args):
    if args.amp_dtype is None:
        return torch.autocast("cpu", enabled=False)
    return torch.autocast("cpu", dtype=args.amp_dtype)


@torch.no_grad()
def heldout_loss(model, ho, seq_len, n_windows, args):
    model.eval()
    n = min(n_windows, (len(ho) - 1) // seq_len)
    tot, cnt = 0.0, 0
    for i in range(0, n, 8):
        xs = [
            torch.from_numpy(ho[j * seq_len : j * seq_len + seq_len + 1].astype(np.int64))
            for j in range(i, min(n, i + 8))
        ]
        b = torch.stack(xs)
        with amp_ctx(args):
            logits = model(input_ids=b[:, :-1]).logits
        loss = F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), b[:, 1:].reshape(-1), reduction="sum"
        )
        tot += loss.item()
        cnt += b[:, 1:].numel()
    model.train()
    return tot / max(cnt, 1)


class CpuShare:
    """CPU cores used by *other* processes since the last call (from /proc).

    The machine's cores are shared; when another job keeps a core busy, two OpenMP
    threads stall each other badly (3x slower steps measured), so the training loop
    drops to one thread while others are busy and goes back up when they stop."""

    def __init__(self):
        self.hz = os.sysconf("SC_CLK_TCK")
        self.prev = self._read()

    @staticmethod
    def _read():
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
            busy = sum(v) - v[3] - v[4]  # minus idle, iowait
            with open("/proc/self/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
            return time.time(), busy, int(st[11]) + int(st[12])
        except (OSError, ValueError, IndexError):
            return None

    def others(self):
        cur = self._read()
        if cur is None or self.prev is None:
            return 0.0
        dt = cur[0] - self.prev[0]
        o = ((cur[1] - self.prev[1]) - (cur[2] - self.prev[2])) / max(dt * self.hz, 1e-9)
        self.prev = cur
        return max(o, 0.0)


def lr_at(frac, peak, warm=0.04, floor=0.1):
    if frac < warm:
        return peak * max(frac / warm, 0.02)
    f = min(1.0, (frac - warm) / (1 - warm))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * f)))


def train_stage(name, model, tr, ho, args, minutes, peak_lr, batch, seed, teacher=None, kl_weight=0.0):
    """Time-budgeted training loop with checkpoint/resume.  Returns a stats dict."""
    from tqdm import tqdm

    run = Path(args.cache) / f"run_{args.run_name}"
    run.mkdir(parents=True, exist_ok=True)
    ckpt = run / f"{name}_ckpt.pt"
    seq = args.seq_len
    opt = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    gen = torch.Generator().manual_seed(seed)
    step, tokens, elapsed, history = 0, 0, 0.0, []
    if args.resume and ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        step, tokens, elapsed, history = st["step"], st["tokens"], st["elapsed"], st["history"]
        log(f"[{name}] resumed at step {step}, {elapsed / 60:.1f} min used")
    budget = minutes * 60.0

    def save():
        torch.save(
            dict(
                model=model.state_dict(),
                opt=opt.state_dict(),
                gen=gen.get_state(),
                step=step,
                tokens=tokens,
                elapsed=elapsed,
                history=history,
            ),
            ckpt,
        )

    model.train()
    if teacher is not None:
        teacher.eval()
    n_start = len(tr) - seq - 1
    t_last = time.time()
    last_save, last_eval = elapsed, elapsed
    bar = tqdm(
        total=int(budget),
        initial=int(min(elapsed, budget)),
        unit="s",
        desc=name,
        mininterval=10,
        file=sys.stdout,
        dynamic_ncols=False,
        ncols=110,
    )
    ema = None
    share = CpuShare()
    while elapsed < budget:
        if args.adaptive_threads and args.threads > 1:
            busy = share.others()
            nthr = 1 if busy > args.threads - 1.5 else args.threads
            if nthr != torch.get_num_threads():
                torch.set_num_threads(nthr)
        frac = elapsed / budget
        lr = lr_at(frac, peak_lr)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, n_start, (batch,), generator=gen).tolist()
        b = torch.from_numpy(np.stack([tr[s : s + seq + 1] for s in starts]).astype(np.int64))
        x, y = b[:, :-1], b[:, 1:]
        with amp_ctx(args):
            logits = model(input_ids=x).logits
        logits = logits.float().reshape(-1, logits.size(-1))
        ce = F.cross_entropy(logits, y.reshape(-1))
        if teacher is not None:
            with torch.no_grad(), amp_ctx(args):
                tl = teacher(input_ids=x).logits
            tlogp = F.log_softmax(tl.float().reshape(-1, tl.size(-1)), -1)
            logq = F.log_softmax(logits, -1)
            kl = (tlogp.exp() * (tlogp - logq)).sum(-1).mean()
            loss = kl_weight * kl + (1 - kl_weight) * ce
        else:
            kl = None
            loss = ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        now = time.time()
        dt, t_last = now - t_last, now
        elapsed += dt
        ema = ce.item() if ema is None else 0.95 * ema + 0.05 * ce.item()
        post = dict(
            ce=f"{ema:.3f}",
            lr=f"{lr:.1e}",
            step=step,
            tok=f"{tokens / 1e6:.2f}M",
            thr=torch.get_num_threads(),
        )
        if kl is not None:
            post["kl"] = f"{kl.item():.3f}"
        bar.set_postfix(post, refresh=False)
        bar.update(int(min(elapsed, budget)) - bar.n)
        if elapsed - last_eval >= args.eval_every * 60 or elapsed >= budget:
            hl = heldout_loss(model, ho, seq, args.eval_windows, args)
            history.append(
                dict(
                    step=step,
                    tokens=tokens,
                    minutes=round(elapsed / 60, 2),
                    train_ce_ema=round(ema, 4),
                    heldout_loss=round(hl, 4),
                    lr=lr,
                )
            )
            log(
                f"[{name}] step {step} tok {tokens:,} {elapsed / 60:.1f}min train_ce {ema:.3f} "
                f"heldout {hl:.4f} (ppl {math.exp(hl):.2f})"
            )
            t_last = time.time()  # eval time is not charged to the budget
            last_eval = elapsed
        if elapsed - last_save >= args.save_every * 60:
            save()
            last_save = elapsed
            t_last = time.time()
    bar.close()
    torch.set_num_threads(args.threads)
    save()
    final = history[-1]["heldout_loss"] if history else heldout_loss(model, ho, seq, args.eval_windows, args)
    return dict(
        steps=step,
        tokens_seen=tokens,
        train_minutes=round(elapsed / 60, 2),
        batch_size=batch,
        seq_len=seq,
        peak_lr=peak_lr,
        seed=seed,
        kl_weight=kl_weight if teacher is not None else None,
        final_heldout_loss=round(final, 4),
        final_heldout_ppl=round(math.exp(final), 3),
        history=history,
    )


# ----------------------------------------------------------------------------- eval
@torch.no_grad()
def decode_latency_ms(model, vocab, prefix=128, n=60, dtype=torch.float32):
    model = model.to(dtype).eval()
    x = torch.randint(2, vocab, (1, prefix), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=x, use_cache=True)
    pkv = out.past_key_values
    tok = torch.tensor([[5]])
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        out = model(input_ids=tok, past_key_values=pkv, use_cache=True)
        ts.append(time.perf_counter() - t)
        pkv = out.past_key_values
    ts.sort()
    model.to(torch.float32)
    return round(1e3 * ts[len(ts) // 2], 3)


@torch.no_grad()
def greedy_agreement(target, draft, hf_tok, prompts, max_new_tokens=64, n_prompts=32):
    """Draft-argmax == target-argmax rate along target-greedy continuations.

    For each prompt the target generates ``max_new_tokens`` greedily; then both
    models score prompt+continuation in one forward and we compare the argmax at
    every position that predicts a continuation token.  Also returns the mean
    sampling acceptance alpha = sum_x min(p(x), q(x)) at temperature 1 there."""
    target.eval()
    draft.eval()
    agree = cnt = 0
    alpha_sum = 0.0
    for pr in prompts[:n_prompts]:
        ids = torch.tensor([hf_tok(pr["text"])["input_ids"]])
        seq = target.generate(
            ids,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=hf_tok.pad_token_id,
            eos_token_id=hf_tok.eos_token_id,
        )
        L = ids.size(1)
        if seq.size(1) <= L:
            continue
        tl = target(input_ids=seq).logits[0, L - 1 : -1].float()
        dl = draft(input_ids=seq).logits[0, L - 1 : -1].float()
        agree += (tl.argmax(-1) == dl.argmax(-1)).sum().item()
        cnt += tl.size(0)
        alpha_sum += torch.minimum(tl.softmax(-1), dl.softmax(-1)).sum(-1).sum().item()
    return dict(
        greedy_agreement=round(agree / max(cnt, 1), 4),
        alpha_t1=round(alpha_sum / max(cnt, 1), 4),
        positions=cnt,
        n_prompts=min(n_prompts, len(prompts)),
        max_new_tokens=max_new_tokens,
    )


def save_hf(model, out_dir: Path, tok_dir: Path, info):
    from transformers import GenerationConfig

    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    m = model.to(torch.bfloat16)
    m.generation_config = GenerationConfig(
        bos_token_id=info["eos_token_id"],
        eos_token_id=info["eos_token_id"],
        pad_token_id=info["pad_token_id"],
        do_sample=False,
    )
    m.save_pretrained(str(out_dir))
    model.to(torch.float32)
    for f in tok_dir.iterdir():
        if f.is_file():
            shutil.copy(f, out_dir / f.name)


# ----------------------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "treespec/zoo/pycode"))
    ap.add_argument("--prompts-out", default=str(REPO / "treespec/zoo/pycode/heldout_prompts.json"))
    ap.add_argument("--cache", default=str(REPO / "experiments/.cache"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--target-minutes", type=float, default=63.0)
    ap.add_argument("--draft-minutes", type=float, default=30.0)
    ap.add_argument("--target-batch", type=int, default=8)
    ap.add_argument("--draft-batch", type=int, default=16)
    ap.add_argument("--target-lr", type=float, default=1e-3)
    ap.add_argument("--draft-lr", type=float, default=2e-3)
    ap.add_argument("--kl-weight", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--amp", choices=["auto", "bf16", "none"], default="auto")
    ap.add_argument("--eval-every", type=float, default=5.0, help="minutes")
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--save-every", type=float, default=5.0, help="minutes")
    ap.add_argument(
        "--no-adaptive-threads",
        dest="adaptive_threads",
        action="store_false",
        help="keep --threads even while other processes keep cores busy",
    )
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="smoke test: tiny models, ~0.3 min stages")
    ap.add_argument(
        "--eval-only", action="store_true", help="only measure agreement/latency of the saved pair in --out"
    )
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    cap = torch.backends.cpu.get_cpu_capability()
    if args.amp == "auto":
        args.amp_dtype = torch.bfloat16 if "AMX" in cap.upper() else None
    else:
        args.amp_dtype = torch.bfloat16 if args.amp == "bf16" else None
    args.run_name = "tiny" if args.tiny else "main"
    tcfg, dcfg = (TINY_TARGET_CFG, TINY_DRAFT_CFG) if args.tiny else (TARGET_CFG, DRAFT_CFG)
    if args.tiny:
        args.target_minutes = min(args.target_minutes, 0.3)
        args.draft_minutes = min(args.draft_minutes, 0.3)
        args.eval_every, args.eval_windows = 0.1, 8
    random.seed(args.seed)
    np.random.seed(args.seed)
    out = Path(args.out)
    t_start = time.time()
    log(f"cpu capability {cap}, amp {args.amp_dtype}, threads {args.threads}")

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.eval_only:
        hf_tok = AutoTokenizer.from_pretrained(str(out / "target"))
        pj = json.loads(Path(args.prompts_out).read_text())
        target = AutoModelForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32)
        draft = AutoModelForCausalLM.from_pretrained(str(out / "draft"), dtype=torch.float32)
        log(json.dumps(greedy_agreement(target, draft, hf_tok, pj["prompts"])))
        for nm, m in (("target", target), ("draft", draft)):
            log(nm, "latency ms fp32", decode_latency_ms(m, hf_tok.vocab_size))
        return

    tok_dir, tr, ho, prompts, info = prepare_data(args)
    t_data = time.time() - t_start
    run = Path(args.cache) / f"run_{args.run_name}"
    run.mkdir(parents=True, exist_ok=True)
    stats = {}

    def stage(
        name: str, model, minutes: float, lr: float, batch: int, seed: int, note: str = "", **train_kw
    ) -> None:
        """Train `model` for one stage, or with --resume load it if that stage finished."""
        done = run / f"{name}_done.json"
        if args.resume and done.exists():
            model.load_state_dict(torch.load(run / f"{name}_final.pt"))
            stats[name] = json.loads(done.read_text())
            log(f"[{name}] already trained; skipping")
            return
        log(f"[{name}] {n_params(model) / 1e6:.2f}M params, {minutes} min{note}")
        t0 = time.time()
        st = train_stage(name, model, tr, ho, args, minutes, lr, batch, seed, **train_kw)
        st["stage_wall_minutes"] = round((time.time() - t0) / 60, 2)
        torch.save(model.state_dict(), run / f"{name}_final.pt")
        done.write_text(json.dumps(st))
        stats[name] = st

    # ---- target
    target = make_model(tcfg, info, args.seq_len, args.seed)
    stage("target", target, args.target_minutes, args.target_lr, args.target_batch, args.seed + 1)
    for p in target.parameters():
        p.requires_grad_(False)

    # ---- draft (distilled from the target)
    draft = make_model(dcfg, info, args.seq_len, args.seed + 10)
    stage(
        "draft",
        draft,
        args.draft_minutes,
        args.draft_lr,
        args.draft_batch,
        args.seed + 11,
        note=f", kl_weight {args.kl_weight}",
        teacher=target,
        kl_weight=args.kl_weight,
    )

    # ---- save HF dirs
    out.mkdir(parents=True, exist_ok=True)
    save_hf(target, out / "target", tok_dir, info)
    save_hf(draft, out / "draft", tok_dir, info)

    # ---- reload offline (bf16 weights -> fp32 compute) and evaluate
    hf_tok = AutoTokenizer.from_pretrained(str(out / "target"))
    assert hf_tok.decode(hf_tok(prompts[0]["text"])["input_ids"]) == prompts[0]["text"]
    t_re = AutoModelForCausalLM.from_pretrained(str(out / "target"), dtype=torch.float32)
    d_re = AutoModelForCausalLM.from_pretrained(str(out / "draft"), dtype=torch.float32)
    for nm, m in (("target", t_re), ("draft", d_re)):
        hl = heldout_loss(m, ho, args.seq_len, args.eval_windows, args)
        stats[nm]["reloaded_bf16_heldout_loss"] = round(hl, 4)
        stats[nm]["reloaded_bf16_heldout_ppl"] = round(math.exp(hl), 3)
        stats[nm]["params"] = n_params(m)
        stats[nm]["config"] = {
            k: getattr(m.config, k)
            for k in [
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "intermediate_size",
                "vocab_size",
                "max_position_embeddings",
                "tie_word_embeddings",
            ]
        }
        stats[nm]["size_bytes_safetensors"] = (out / nm / "model.safetensors").stat().st_size
    lat = {}
    for thr in sorted({1, args.threads}):
        torch.set_num_threads(thr)
        for dt_name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            lt = decode_latency_ms(t_re, info["vocab_size"], dtype=dt)
            ld = decode_latency_ms(d_re, info["vocab_size"], dtype=dt)
            lat[f"threads{thr}_{dt_name}"] = dict(
                target_ms=lt, draft_ms=ld, draft_over_target=round(ld / lt, 4)
            )
    torch.set_num_threads(args.threads)
    log("decode latency (batch 1, 128-token KV prefix, median ms):", json.dumps(lat))
    agr = greedy_agreement(t_re, d_re, hf_tok, prompts, max_new_tokens=64, n_prompts=8 if args.tiny else 32)
    log("agreement:", json.dumps(agr))
    gen = t_re.generate(
        torch.tensor([hf_tok(prompts[0]["text"])["input_ids"]]), max_new_tokens=40, do_sample=False
    )
    log("sample target continuation:\n" + hf_tok.decode(gen[0]))

    logd = dict(
        description="Bundled pycode pair (Llama target + distilled draft) trained on CPython "
        "stdlib sources by experiments/build/train_pycode_pair.py",
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        seeds=dict(
            global_seed=args.seed,
            target_init=args.seed,
            target_data=args.seed + 1,
            draft_init=args.seed + 10,
            draft_data=args.seed + 11,
        ),
        torch=torch.__version__,
        cpu_capability=cap,
        threads=args.threads,
        amp=str(args.amp_dtype),
        data=info,
        data_prep_minutes=round(t_data / 60, 2),
        target=stats["target"],
        draft=stats["draft"],
        decode_latency_ms=lat,
        agreement=agr,
        total_wall_minutes_this_invocation=round((time.time() - t_start) / 60, 2),
        note="Weights stored in bf16; load with dtype=torch.float32 on CPUs without AMX "
        "(bf16 matmuls are slower than fp32 there).",
    )
    (out / "training_log.json").write_text(json.dumps(logd, indent=1) + "\n")
    log(f"done in {(time.time() - t_start) / 60:.1f} min; wrote {out}")


if __name__ == "__main__":
    main()
