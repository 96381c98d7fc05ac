"""Training one draft (or a feature head) on the stored distributions: deterministic,
budgeted, resumable.

`train_model(model, job)` is the loop; `job.loss(sequences)` is what a step minimises (a draft's
divergence from the stored top-k: `draft_loss`; a feature head's: `treespec.distill.head`).
Everything a step does is a function of the step number and the checkpointed state:
the sequences of step s are entries s*B .. s*B+B-1 of the concatenated per-epoch
permutations (seeded by the recipe seed, the draft index and the epoch), the learning rate
is `lr_at(s, total)` (linear warm-up, then cosine to min_lr_ratio x lr) and the optimizer
state is saved with the weights. A resumed run therefore reproduces the uninterrupted one
bit for bit.

The step count is `recipe.steps`, or `epochs` passes without a time budget. With one, it is
what fits in the draft's share of the budget at the median time of recent steps: planned at
the end of the warm-up (at least `CALIBRATION_STEPS` steps) and re-planned after each
evaluation, so a machine that slows down or speeds up moves the end of the cosine schedule
(evaluations are not charged to the budget). Each plan is checkpointed with the rest; a run
interrupted after a plan reproduces the uninterrupted one, one interrupted before re-plans.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..backends.subset import VocabMap
from .data import Batch, Dataset
from .losses import buckets, divergence, tv_distance

CALIBRATION_STEPS = 5  # steps timed (at least; the warm-up if longer) before a budget plans the count
CALIBRATION_WINDOW = 20  # recent steps whose median time plans the rest
RESERVE_SECONDS = 2.0  # of a draft's budget share, kept for its final save


@dataclass
class Clock:
    """The budget clock of a run: wall-clock time for data + training, across invocations
    (`save()` at every checkpoint records the time spent so far, and a resumed run starts from
    there). Evaluations run `paused()`: they are reported, not charged to the budget."""

    budget: float | None  # seconds for data + training (None: no budget)
    path: Path  # where the time spent up to the last checkpoint is kept
    spent: float = 0.0  # seconds spent by earlier invocations, up to their last checkpoint
    start: float = field(default_factory=time.time)
    paused_seconds: float = 0.0  # time spent paused by this invocation

    @classmethod
    def load(cls, path: Path, budget: float | None) -> Clock:
        spent = json.loads(path.read_text())["elapsed"] if path.is_file() else 0.0
        return cls(budget, path, spent)

    def elapsed(self) -> float:
        return self.spent + time.time() - self.start - self.paused_seconds

    @contextmanager
    def paused(self):
        t0 = time.time()
        try:
            yield
        finally:
            self.paused_seconds += time.time() - t0

    def save(self) -> None:
        self.path.write_text(json.dumps({"elapsed": round(self.elapsed(), 3)}) + "\n")


def draft_logprobs(draft, batch: Batch, vocab_map: VocabMap | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's log q at the batch's loss rows, [M, V_draft], and the stored target ids as
    columns of it, [M, k] (-1: outside a subset vocabulary)."""
    ids_in = batch.input_ids if vocab_map is None else vocab_map.input_rows(batch.input_ids)
    device = draft.device
    hidden = draft.model(
        input_ids=ids_in.to(device), attention_mask=batch.attention_mask.to(device)
    ).last_hidden_state
    logits = draft.lm_head(
        hidden[batch.where[0].to(device), batch.where[1].to(device)]
    ).float()  # [M, V_draft]
    if vocab_map is None:
        return torch.log_softmax(logits, -1), batch.topk_ids.to(device)
    logits[:, vocab_map.size] = float("-inf")  # the "every other token" row is never proposed
    return torch.log_softmax(logits, -1), vocab_map.output_rows(batch.topk_ids.to(device))


def batch_loss(draft, batch: Batch, vocab_map, loss: str, weights: torch.Tensor | None) -> torch.Tensor:
    """The recipe's divergence, averaged over the batch's rows (weighted if `weights` [R])."""
    logq, ids = draft_logprobs(draft, batch, vocab_map)
    P, Q, logQ = buckets(logq, ids, batch.topk_probs.to(logq.device), ids >= 0)
    per_row = divergence(loss, P, Q, logQ)  # [M]
    if weights is None:
        return per_row.mean()
    w = weights[batch.rows].to(per_row.device)
    return (w * per_row).sum() / w.sum().clamp(min=1e-12)


@torch.no_grad()
def rejection_weights(draft, data: Dataset, vocab_map, batch_size: int = 16) -> np.ndarray:
    """[R] TV(p, q) of `draft` at every stored row: where it is rejected (boost-tuning weights)."""
    out = np.zeros(data.n_rows, dtype=np.float32)
    every = np.ones(data.n_rows, dtype=bool)
    for start in range(0, len(data), batch_size):
        batch = data.batch(list(range(start, min(len(data), start + batch_size))), every)
        logq, ids = draft_logprobs(draft, batch, vocab_map)
        P, Q, _ = buckets(logq, ids, batch.topk_probs.to(logq.device), ids >= 0)
        out[batch.rows.numpy()] = tv_distance(P, Q).cpu().numpy()
    return out


def lr_at(step: int, total: int | None, recipe) -> float:
    """Linear warm-up over `warmup_steps`, then cosine from lr to min_lr_ratio x lr at `total`."""
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    if total is None:
        return recipe.lr
    progress = min(1.0, (step - recipe.warmup_steps) / max(1, total - recipe.warmup_steps))
    return recipe.lr * (
        recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    )


class Order:
    """Which sequences step s trains on: the per-epoch seeded permutations, concatenated."""

    def __init__(self, n: int, batch_size: int, seed: int, index: int):
        self.n, self.batch_size, self.key = n, batch_size, (seed, index)
        self._epoch, self._perm = -1, None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, np.random.default_rng([*self.key, epoch]).permutation(self.n)
        return self._perm

    def __call__(self, step: int) -> list[int]:
        out = []
        for j in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, r = divmod(j, self.n)
            out.append(int(self._permutation(epoch)[r]))
        return out


def eval_steps(total: int, evals: int) -> set[int]:
    return {max(1, round(total * j / evals)) for j in range(1, evals + 1)}


def draft_loss(draft, data: Dataset, vocab_map: VocabMap | None, recipe, weights: np.ndarray | None):
    """A step's loss for a draft model: the recipe's divergence at the loss rows of the step's
    sequences (per-row `weights` [R] for boost-tuning, None: uniform)."""
    rows = data.row_mask(recipe.train_on_prompt)
    w = None if weights is None else torch.from_numpy(weights)
    return lambda seqs: batch_loss(draft, data.batch(seqs, rows), vocab_map, recipe.loss, w)


@dataclass
class Job:
    """What `train_model` needs besides the model."""

    n_sequences: int  # the data's sequences (a step trains on `recipe.batch_size` of them)
    recipe: object  # lr, warmup_steps, min_lr_ratio, grad_clip, weight_decay, batch_size, steps,
    # epochs, seed, evals, checkpoint_minutes (a `Recipe`, or a `HeadRecipe`)
    loss: Callable[[list[int]], torch.Tensor]  # the mean loss over a step's sequences (indices)
    index: int  # 0 for the first draft, i for the (i+1)-th boost-tuned one
    checkpoint: Path
    clock: Clock
    until: float | None  # clock.elapsed() at which this model's budget share ends (None: no budget)
    evaluate: Callable  # (model, step, mean loss since the last evaluation or None) -> eval record
    progress: Callable | None = None  # tqdm factory, or None
    name: str = "draft"  # the progress bar's label


def _save(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def fixed_total(recipe, n_sequences: int, budgeted: bool) -> int | None:
    """The step count known before training: `steps`, or `epochs` passes without a budget."""
    if recipe.steps is not None:
        return recipe.steps
    return None if budgeted else max(1, math.ceil(recipe.epochs * n_sequences / recipe.batch_size))


def train_model(draft, job: Job) -> dict:
    """Train `draft` (a draft model or a feature head) in place, resuming from `job.checkpoint`
    if it exists; its summary."""
    recipe = job.recipe
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, betas=(0.9, 0.95), weight_decay=recipe.weight_decay)
    order = Order(job.n_sequences, recipe.batch_size, recipe.seed, job.index)
    if job.checkpoint.is_file():
        state = torch.load(job.checkpoint, weights_only=False)
        draft.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        _set_rng_state(state["rng"])
    else:
        job.evaluate(draft, 0, None)
        state = {
            "step": 0,
            "total": fixed_total(recipe, job.n_sequences, job.until is not None),
            "losses": [],
            "step_seconds": [],
            "done": False,
            "since_eval": [],
        }
        state["budgeted"] = state["total"] is None  # the step count follows the time budget
    if state["done"]:
        return _summary(draft, state)
    bar = (
        job.progress(total=state["total"], initial=state["step"], desc=f"{job.name} {job.index + 1}")
        if job.progress
        else None
    )
    last_save = time.time()
    draft.train()
    while state["total"] is None or state["step"] < state["total"]:
        step, t0 = state["step"], time.time()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, state["total"], recipe)
        loss = job.loss(order(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, recipe.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(loss.detach())
        state["step"] = step + 1
        state["losses"].append(loss)
        state["since_eval"].append(loss)
        state["step_seconds"].append(time.time() - t0)
        if state["total"] is None and state["step"] >= max(CALIBRATION_STEPS, recipe.warmup_steps):
            state["total"] = _budgeted_total(state, job)
            if bar is not None:
                bar.total = state["total"]
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
        if state["total"] is not None and state["step"] in eval_steps(state["total"], recipe.evals):
            record = job.evaluate(draft, state["step"], float(np.mean(state["since_eval"])))
            state["since_eval"] = []
            if state["budgeted"] and state["step"] < state["total"]:  # re-plan at the recent step time
                state["total"] = _budgeted_total(state, job)
                if bar is not None:
                    bar.total = state["total"]
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.3f}", acc1_T0=record["T0"]["acceptance_by_depth"][0])
            draft.train()
        state["done"] = state["total"] is not None and state["step"] >= state["total"]
        if state["done"] or time.time() - last_save >= recipe.checkpoint_minutes * 60:
            _save(
                job.checkpoint,
                {**state, "model": draft.state_dict(), "optimizer": opt.state_dict(), "rng": _rng_state()},
            )
            job.clock.save()
            last_save = time.time()
    if bar is not None:
        bar.close()
    draft.eval()
    return _summary(draft, state)


def _budgeted_total(state: dict, job: Job) -> int:
    """Steps that fit in what is left of this draft's share of the budget, at the median time
    of the last `CALIBRATION_WINDOW` steps (the first step, which pays for allocations, never)."""
    t_step = float(np.median(state["step_seconds"][1:][-CALIBRATION_WINDOW:]))
    return state["step"] + max(1, int((job.until - job.clock.elapsed() - RESERVE_SECONDS) / t_step))


def _summary(draft, state: dict) -> dict:
    losses = state["losses"]
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "steps": state["step"],
        "train_seconds": round(sum(state["step_seconds"]), 1),
        "seconds_per_step": round(float(np.median(state["step_seconds"])), 4)
        if state["step_seconds"]
        else None,
        "loss_first": round(losses[0], 4) if losses else None,
        "loss_last_10pct": round(float(np.mean(tail)), 4) if losses else None,
        "params": sum(p.numel() for p in draft.parameters()),
    }
