"""Distillation data: the target's own responses and its top-k distributions, made once.

For each batch of prompts (token ids), the target samples a response with treespec's batched
plain decoding (`generate_batch(tree=None)`: on-policy data, as DistillSpec prescribes),
reporting at each step the `top_k` probabilities of the distribution it sampled from (int32 ids,
float16 probs); a teacher-forced forward over the prompts adds their rows when the draft learns
them. Each batch is one safetensors shard, so an interrupted data phase resumes at the next
shard and training never runs the target again.

Shard arrays (S sequences, T tokens, R = T - S stored positions, k = top_k):

    tokens      int32   [T]      prompt + response of every sequence, concatenated
    offsets     int64   [S + 1]  sequence s is tokens[offsets[s] : offsets[s + 1]]
    prompt_len  int32   [S]      its prompt's length
    topk_ids    int32   [R, k]   row offsets[s] - s + j: the target's top-k after tokens[.. j]
                                 (-1: a prompt row not kept, probability 0)
    topk_probs  float16 [R, k]   their probabilities (the tail is 1 - their sum)
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import SamplingConfig

LOGITS_BYTES = 1 << 28  # the teacher forward holds at most this much of logits at once


def teacher_topk(model, seqs: list[list[int]], k: int) -> tuple[np.ndarray, np.ndarray]:
    """The target's top-k after every position but the last of each sequence: ids [R, k]
    int32 and probs [R, k] float16, sequences concatenated in order (R = sum(len - 1))."""
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    ids_out, probs_out = [], []
    i = 0
    while i < len(seqs):
        n, longest = 1, len(seqs[i])  # as many sequences as fit in LOGITS_BYTES of fp32 logits
        while i + n < len(seqs) and (n + 1) * max(longest, len(seqs[i + n])) * vocab * 4 <= LOGITS_BYTES:
            longest = max(longest, len(seqs[i + n]))
            n += 1
        chunk = seqs[i : i + n]
        batch = torch.zeros(n, longest, dtype=torch.long)
        mask = torch.zeros(n, longest, dtype=torch.long)
        for b, s in enumerate(chunk):
            batch[b, : len(s)] = torch.tensor(s)
            mask[b, : len(s)] = 1
        with torch.inference_mode():
            logits = model(input_ids=batch.to(device), attention_mask=mask.to(device)).logits  # [n, L, V]
            for b, s in enumerate(chunk):
                p = torch.softmax(logits[b, : len(s) - 1].float(), -1)  # [len - 1, V]
                top = torch.topk(p, k, dim=-1)
                ids_out.append(top.indices.to(torch.int32).cpu().numpy())
                probs_out.append(top.values.to(torch.float16).cpu().numpy())
        i += n
    return np.concatenate(ids_out), np.concatenate(probs_out)


def make_shard(decoder, teacher, prompts: list[list[int]], seeds: list[int], recipe) -> dict[str, np.ndarray]:
    """Sample the target's responses to `prompts` and keep its top-k along prompt + response.

    The response rows are the distributions the responses were sampled from, as generation
    reports them (`logprobs=top_k`: the target's raw logits, before temperature), so the
    target runs once per response token. The prompt rows take one teacher-forced forward over
    the prompts when the draft learns them (`train_on_prompt`), else they stay empty (ids -1,
    probability 0: no loss row reads them)."""
    k = recipe.top_k
    outs = decoder.generate_batch(
        prompts,
        max_new_tokens=recipe.response_tokens,
        tree=None,
        sampling=SamplingConfig(temperature=recipe.temperature),
        seeds=seeds,
        max_batch=len(prompts),
        logprobs=k,
    )
    seqs = [list(p) + list(o.token_ids) for p, o in zip(prompts, outs)]
    if recipe.train_on_prompt:
        prompt_ids, prompt_probs = teacher_topk(teacher, prompts, k)
    else:
        n = sum(len(p) - 1 for p in prompts)
        prompt_ids, prompt_probs = np.full((n, k), -1, dtype=np.int32), np.zeros((n, k), dtype=np.float16)
    ids, probs, start = [], [], 0
    for p, o in zip(prompts, outs):  # per sequence: its prompt rows, then its response rows
        ids += [prompt_ids[start : start + len(p) - 1], o.logprobs.top_ids.numpy().astype(np.int32)]
        probs += [prompt_probs[start : start + len(p) - 1], o.logprobs.top.exp().numpy().astype(np.float16)]
        start += len(p) - 1
    return {
        "tokens": np.concatenate([np.asarray(s, dtype=np.int32) for s in seqs]),
        "offsets": np.cumsum([0] + [len(s) for s in seqs]).astype(np.int64),
        "prompt_len": np.asarray([len(p) for p in prompts], dtype=np.int32),
        "topk_ids": np.concatenate(ids),
        "topk_probs": np.concatenate(probs),
    }


def save_shard(arrays: dict[str, np.ndarray], path: Path) -> None:
    from safetensors.numpy import save_file

    tmp = path.with_suffix(".tmp")
    save_file(arrays, str(tmp))
    tmp.replace(path)


def load_shard(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def prompt_seed(seed: int, index: int) -> int:
    """The sampling seed of training prompt `index` (independent of how prompts are batched)."""
    return seed * 1_000_003 + index


def make_data(
    decoder, teacher, prompts, recipe, data_dir: Path, deadline: float | None, on_shard=None
) -> dict:
    """Shards of `gen_batch` prompts (`prompts.take(start, n)`: token ids) until the prompts
    run out or `deadline` (time.time()) passes; shards already in `data_dir` are kept (resume).
    Returns meta.json's record: shards, prompts, seconds, complete. Once complete, the data
    never changes. `on_shard(meta)` runs after each new shard."""
    data_dir.mkdir(parents=True, exist_ok=True)
    meta_path = data_dir / "meta.json"
    meta = (
        json.loads(meta_path.read_text())
        if meta_path.is_file()
        else {"shards": 0, "prompts": 0, "seconds": 0.0}
    )
    while not meta.get("complete"):
        batch = prompts.take(meta["prompts"], recipe.gen_batch)
        if not batch or (deadline is not None and meta["shards"] and time.time() >= deadline):
            meta["complete"] = True
        else:
            t0 = time.time()
            seeds = [prompt_seed(recipe.seed, meta["prompts"] + i) for i in range(len(batch))]
            save_shard(
                make_shard(decoder, teacher, batch, seeds, recipe),
                data_dir / f"shard_{meta['shards']:05d}.safetensors",
            )
            meta.update(
                shards=meta["shards"] + 1,
                prompts=meta["prompts"] + len(batch),
                seconds=round(meta["seconds"] + time.time() - t0, 3),
            )
        meta_path.write_text(json.dumps(meta) + "\n")
        if on_shard is not None:
            on_shard(meta)
    return meta


@dataclass
class Batch:
    """One training batch: B padded sequences and the stored positions the loss reads."""

    input_ids: torch.Tensor  # [B, L] int64 (padding: 0)
    attention_mask: torch.Tensor  # [B, L] int64
    where: tuple[torch.Tensor, torch.Tensor]  # ([M] sequence in batch, [M] position): the loss rows
    topk_ids: torch.Tensor  # [M, k] int64 target ids
    topk_probs: torch.Tensor  # [M, k] float32
    rows: torch.Tensor  # [M] int64 global row index (for per-position weights)


class Dataset:
    """Every shard of a data directory, concatenated in memory (6 x top_k bytes per position)."""

    def __init__(self, shards: list[dict[str, np.ndarray]]):
        if not shards:
            raise ValueError("no data shards")
        self.tokens = np.concatenate([s["tokens"] for s in shards])
        lengths = np.concatenate([np.diff(s["offsets"]) for s in shards])
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.prompt_len = np.concatenate([s["prompt_len"] for s in shards])
        self.topk_ids = np.concatenate([s["topk_ids"] for s in shards])
        self.topk_probs = np.concatenate([s["topk_probs"] for s in shards])
        assert len(self.topk_ids) == len(self.tokens) - len(lengths)

    @classmethod
    def from_dir(cls, data_dir: Path, n_shards: int) -> Dataset:
        return cls([load_shard(data_dir / f"shard_{i:05d}.safetensors") for i in range(n_shards)])

    def __len__(self) -> int:
        return len(self.prompt_len)

    @property
    def n_rows(self) -> int:
        return len(self.topk_ids)

    def row_mask(self, train_on_prompt: bool) -> np.ndarray:
        """[R] bool: the rows the loss reads (response positions, and prompt ones if asked)."""
        keep = np.ones(self.n_rows, dtype=bool)
        if not train_on_prompt:
            for s in range(len(self)):
                first = self.offsets[s] - s
                keep[first : first + self.prompt_len[s] - 1] = False
        return keep

    def batch(self, seqs: list[int] | np.ndarray, rows_mask: np.ndarray) -> Batch:
        """Sequences `seqs`, padded on the right; loss rows where `rows_mask` is True."""
        lengths = [int(self.offsets[s + 1] - self.offsets[s]) for s in seqs]
        L = max(lengths)
        input_ids = torch.zeros(len(seqs), L, dtype=torch.long)
        mask = torch.zeros(len(seqs), L, dtype=torch.long)
        which, pos, rows = [], [], []
        for b, (s, n) in enumerate(zip(seqs, lengths)):
            input_ids[b, :n] = torch.from_numpy(
                self.tokens[self.offsets[s] : self.offsets[s + 1]].astype(np.int64)
            )
            mask[b, :n] = 1
            first = int(self.offsets[s] - s)
            js = np.nonzero(rows_mask[first : first + n - 1])[0]
            which.append(np.full(len(js), b))
            pos.append(js)
            rows.append(first + js)
        rows_t = torch.from_numpy(np.concatenate(rows).astype(np.int64))
        return Batch(
            input_ids,
            mask,
            (
                torch.from_numpy(np.concatenate(which).astype(np.int64)),
                torch.from_numpy(np.concatenate(pos).astype(np.int64)),
            ),
            torch.from_numpy(self.topk_ids[rows_t.numpy()].astype(np.int64)),
            torch.from_numpy(self.topk_probs[rows_t.numpy()].astype(np.float32)),
            rows_t,
        )

    def sequences(self) -> list[np.ndarray]:
        """Every stored sequence (prompt + response), as int32 token ids."""
        return [self.tokens[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:])]

    def prompts(self) -> list[list[int]]:
        """Every stored sequence's prompt, as token ids."""
        return [seq[:n].tolist() for seq, n in zip(self.sequences(), self.prompt_len)]

    def response_rows(self) -> np.ndarray:
        return self.row_mask(train_on_prompt=False)

    def token_mass(self, vocab: int) -> np.ndarray:
        """[vocab] float64: the target's probability mass per token, summed over the response rows."""
        keep = self.response_rows()
        mass = np.zeros(vocab, dtype=np.float64)
        np.add.at(mass, self.topk_ids[keep].ravel(), self.topk_probs[keep].astype(np.float64).ravel())
        return mass
