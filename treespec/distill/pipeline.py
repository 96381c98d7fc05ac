"""`distill()`: from a target model to a ready-to-use draft directory, in one call.

    check inputs -> prompts -> data (target responses + top-k) -> draft(s) -> save + evaluate

Everything is checked before any work (one-line ValueErrors). State lives in `out/work/`
(run.json: what was asked; data/: shards; draft_<i>.pt: checkpoints; clock.json: time spent),
so `resume=True` continues an interrupted run exactly where its last checkpoint left it. The
draft is written to `out/` itself (boost-tuned drafts 2..N to `out/boost_<i>/`), with
`distill.json` (recipe, data, losses, acceptance), `eval.jsonl`, `eval.png` and `counts.npz`
(unigram / bigram counts of the training prompts and responses: `UnigramDrafter(counts_file=)`).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from ..backends.subset import VocabMap
from ..drafters.counts import write_counts
from .data import Dataset, load_shard, make_data, make_shard, prompt_seed, save_shard
from .evaluate import acceptance, merged_acceptance, plot, proxy, read_jsonl
from .model import build_draft, draft_runner, load_draft, load_draft_runner, save_draft
from .prompts import (
    SELF,
    Rendered,
    SelfPrompts,
    bundled_prompts,
    check_renderable,
    load_prompt_file,
    split_heldout,
)
from .recipe import Recipe
from .train import Clock, Job, draft_loss, rejection_weights, train_model

# recipe fields a resumed run may change: they do not alter what is computed
MACHINE_FIELDS = ("progress", "threads", "checkpoint_minutes")
# recipe fields that decide the data (training shards and the held-out shard)
DATA_FIELDS = ("max_prompts", "prompt_tokens", "response_tokens", "temperature", "top_k", "gen_batch",
               "proxy_prompts", "eval_prompts", "seed", "target_dtype")  # fmt: skip


_DEFAULTS = Recipe().as_dict()


def distill(
    target,
    out_dir,
    prompts=None,
    minutes: float | None = None,
    resume: bool = False,
    data_from=None,
    data_only: bool = False,
    **recipe,
) -> Path:
    """Distill a draft for `target` (HF directory, GGUF file or hub id) into `out_dir`.

    `prompts`: a .txt / .jsonl / .json prompt file (default: the bundled set suited to the
    target, see `prompts.py`). `minutes`: wall-clock budget for data + training (None: all
    prompts, `recipe.steps` or `recipe.epochs`); evaluations are not charged to it. `resume`:
    continue the run in `out_dir`. `data_from`: the output directory of a finished run, or a list
    of them, whose data this run reuses instead of making its own: to compare recipes on equal
    data, or to train on more data than one run made (runs with different seeds sample other
    responses to the same prompts; see `_reusable_data` for what must match). `data_only`: stop
    after the data phase, which then has the whole budget (its output is for `data_from`).
    `recipe`: `Recipe` fields. Returns `out_dir`, which
    `SpeculativeDecoder.from_pretrained(target=target, draft=out_dir)` loads."""
    if minutes is not None and (
        isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not minutes > 0
    ):
        raise ValueError(f"minutes must be a number > 0 (or None: no time budget), got {minutes!r}")
    Recipe.from_kwargs(recipe)
    if data_only and data_from is not None:
        raise ValueError("data_only with data_from leaves nothing to do: give one of them")
    check_target(target)
    prompt_list = load_prompt_file(prompts) if prompts not in (None, SELF) else None
    out = Path(out_dir)
    _check_writable(out, resume)
    work = out / "work"
    run = _run_record(target, prompts, minutes, resume, recipe, work, data_only)
    sources = None
    if data_from is not None and not resume:
        runs = [data_from] if isinstance(data_from, (str, os.PathLike)) else list(data_from)
        sources = _reusable_data([Path(d) for d in runs], run)
        run["data_from"] = [str(d) for d in runs] if len(runs) > 1 else str(runs[0])
    work.mkdir(parents=True, exist_ok=True)
    if sources is not None:
        _copy_data(sources, work / "data")
    (work / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    return _Run(target, out, Recipe.from_kwargs(run["recipe"]), run["minutes"], prompt_list, run).execute()


def _run_record(target, prompts, minutes, resume: bool, given: dict, work: Path, data_only: bool) -> dict:
    """What this run is: the stored record on resume (checked against what was passed)."""
    record = {
        "target": str(target),
        "prompts": None if prompts is None else str(prompts),
        "minutes": minutes,
        "data_only": data_only,
        "recipe": Recipe.from_kwargs(given).as_dict(),
    }
    if not resume:
        return record
    path = work / "run.json"
    if not path.is_file():
        raise ValueError(f"nothing to resume in {work.parent}: no {path.name} (start without resume)")
    stored = json.loads(path.read_text())
    for key in ("target", "prompts"):
        if record[key] != stored[key] and (key != "prompts" or prompts is not None):
            raise ValueError(
                f"resume with {key} {record[key]!r}, but the run in {work.parent} used {stored[key]!r}"
            )
    if minutes is not None and minutes != stored["minutes"]:
        raise ValueError(f"resume with minutes={minutes}, but the run used minutes={stored['minutes']}")
    if data_only != stored.get("data_only", False):
        raise ValueError(
            f"resume with data_only={data_only}, but the run used data_only={stored.get('data_only', False)} "
            f"(train on a data-only run's data with data_from instead)"
        )
    stored["recipe"] = {**_DEFAULTS, **stored["recipe"]}  # a field added since that run: its default
    changed = sorted(k for k, v in given.items() if k not in MACHINE_FIELDS and v != stored["recipe"][k])
    if changed:
        used = ", ".join(f"{k}={stored['recipe'][k]!r}" for k in changed)
        raise ValueError(f"resume cannot change {', '.join(changed)} (the run used {used})")
    return {
        **stored,
        "recipe": {**stored["recipe"], **{k: v for k, v in given.items() if k in MACHINE_FIELDS}},
    }


def _reusable_data(others: list[Path], run: dict) -> list[Path]:
    """The data directories of the runs in `others`, if each is complete and made as `run`
    would make it (their seeds, which decide the sampled responses, and gen_batch may differ),
    no two share a seed (they would hold the same samples) and all hold out the same prompts."""
    if not others:
        raise ValueError("data_from: give at least one finished distill run")
    seeds = []
    for other in others:
        meta, record = other / "work" / "data" / "meta.json", other / "work" / "run.json"
        if not meta.is_file() or not json.loads(meta.read_text()).get("complete") or not record.is_file():
            raise ValueError(f"data_from: {other} holds no finished distill data")
        theirs = json.loads(record.read_text())
        differ = ["target"] if theirs["target"] != run["target"] else []  # prompts: the held-out check
        differ += [
            k
            for k in DATA_FIELDS
            if k not in ("seed", "gen_batch") and theirs["recipe"].get(k, _DEFAULTS[k]) != run["recipe"][k]
        ]
        if differ:
            raise ValueError(f"data_from: {other} made its data with other {', '.join(differ)}")
        seeds.append(theirs["recipe"]["seed"])
    if len(set(seeds)) < len(seeds):
        raise ValueError(
            f"data_from: the runs used seeds {seeds}; two runs with one seed sampled the same "
            f"responses: give runs with distinct seeds"
        )
    held = [Dataset([load_shard(o / "work" / "data" / "heldout.safetensors")]).prompts() for o in others]
    for other, h in zip(others[1:], held[1:]):
        if h != held[0]:
            raise ValueError(
                f"data_from: {other} holds out other prompts than {others[0]} (was the prompt file "
                f"changed?): training on both would train on held-out prompts"
            )
    return [o / "work" / "data" for o in others]


def _copy_data(sources: list[Path], data: Path) -> None:
    """The shards of `sources` (data directories) renumbered into `data`, the first one's
    held-out shard, and a complete meta.json summing theirs."""
    data.mkdir(parents=True)
    shutil.copy2(sources[0] / "heldout.safetensors", data / "heldout.safetensors")
    total = {"shards": 0, "prompts": 0, "seconds": 0.0}
    for source in sources:
        meta = json.loads((source / "meta.json").read_text())
        for i in range(meta["shards"]):
            name = f"shard_{total['shards'] + i:05d}.safetensors"
            shutil.copy2(source / f"shard_{i:05d}.safetensors", data / name)
        total = {k: total[k] + meta[k] for k in total}
    (data / "meta.json").write_text(
        json.dumps({**total, "seconds": round(total["seconds"], 3), "complete": True}) + "\n"
    )


def _check_writable(out: Path, resume: bool) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"cannot write to the output directory {str(out)!r}: {e.strerror or e}") from None
    if not resume and any(out.iterdir()):
        raise ValueError(
            f"the output directory {str(out)!r} is not empty; pass resume=True to continue its run there, "
            f"or use a new one"
        )


def check_target(target) -> None:
    """ValueError unless `target` names a model: a local directory with config.json, a GGUF
    file (or a directory holding one), or something shaped like a hub id (a download that
    fails, fails later). Nothing is loaded or converted."""
    from ..backends import hf
    from ..loading import gguf

    if target is None:
        raise ValueError("target is None; give a model directory, a .gguf file or a hub id")
    local = Path(os.fspath(target)).expanduser() if isinstance(target, (str, os.PathLike)) else None
    if local is not None and (
        local.suffix == ".gguf"
        or (local.is_dir() and not (local / "config.json").exists())
        and any(local.glob("*.gguf"))
    ):
        gguf.gguf_file(local)
        return
    hf.resolve_path(target)


class _Run:
    """One distillation run; `execute()` does it (each phase skips what `work/` already holds)."""

    def __init__(self, target, out: Path, recipe: Recipe, minutes, prompt_list, record: dict):
        from ..loading import checkpoint

        # a GGUF file is converted once into a cached HF directory (treespec.loading.gguf)
        self.target_path, self.out, self.recipe, self.record = checkpoint(target), out, recipe, record
        self.work, self.minutes, self.prompt_list = out / "work", minutes, prompt_list
        self.eval_path = out / "eval.jsonl"

    def execute(self) -> Path:
        from ..backends import hf
        from ..decoder import SpeculativeDecoder

        rec = self.recipe
        if rec.threads is not None:
            torch.set_num_threads(rec.threads)
        self.clock = Clock.load(self.work / "clock.json", None if self.minutes is None else self.minutes * 60)
        hf.quiet_transformers()
        self.tokenizer = hf.load_tokenizer(self.target_path)
        if self.tokenizer is None:
            raise ValueError(
                f"no tokenizer with the target {str(self.target_path)!r}; distill needs it to render prompts"
            )
        train, held = self._prompts()
        dtype = getattr(torch, rec.target_dtype)
        self.target = hf.load_model(self.target_path, dtype, torch.device(rec.device))
        cfg = self.target.config
        if rec.vocab_subset is not None and rec.vocab_subset >= cfg.vocab_size:
            raise ValueError(
                f"vocab_subset {rec.vocab_subset} must be below the target's {cfg.vocab_size} tokens"
            )
        max_pos = cfg.max_position_embeddings
        if rec.response_tokens >= max_pos or rec.eval_tokens >= max_pos:
            raise ValueError(f"response_tokens / eval_tokens must be below the target's {max_pos} positions")
        self.generator = SpeculativeDecoder(self.target, None, self.tokenizer)
        self.target_runner = self.generator.target_runner
        held_ids = Rendered(held, self.tokenizer, max_pos - max(rec.response_tokens, rec.eval_tokens)).take(
            0, max(rec.eval_prompts, rec.proxy_prompts)
        )
        self.eval_ids = held_ids[: rec.eval_prompts]
        self.heldout = self._heldout_data(held_ids[: rec.proxy_prompts])
        fits = min(rec.prompt_tokens, max_pos - rec.response_tokens)
        if train is SELF:
            train_ids = SelfPrompts(self.generator, self.tokenizer, rec.seed, fits, rec.max_prompts)
        else:
            train_ids = Rendered(train, self.tokenizer, fits, rec.max_prompts)
        data, meta = self._data(train_ids)
        if self.record.get("data_only"):
            self._write_summary(data, meta, None, [], None)
            return self.out
        vocab_map, coverage = self._vocab_map(data)
        self._prune_eval_log()
        drafts, summaries, weights = [], [], None
        for i in range(rec.drafts):
            if i:
                prev = rejection_weights(drafts[-1], data, vocab_map)
                weights = prev if weights is None else weights * prev
            draft, summary = self._draft(i, data, vocab_map, weights)
            drafts.append(draft)
            summaries.append(summary)
        merged = None
        if len(drafts) > 1:
            runners = [load_draft_runner(self._draft_dir(i)) for i in range(len(drafts))]
            merged = merged_acceptance(
                self.target_runner, self.tokenizer, runners, self.eval_ids, rec.eval_tokens, cfg.vocab_size
            )
        self._write_summary(data, meta, coverage, summaries, merged)
        write_counts(  # the unigram / bigram drafters of this target, from the same text
            data.sequences(), cfg.vocab_size, self.out / "counts.npz",
            meta={"corpus": f"{meta['prompts']} training prompts and the target's responses"},
        )  # fmt: skip
        plot(self.eval_path, self.out / "eval.png")
        from ..planning import write_acceptance  # what the automatic tree plans with, beside the draft

        dec = SpeculativeDecoder(self.target_runner, load_draft_runner(self.out), self.tokenizer)
        write_acceptance(dec, self.eval_ids, self.out, rec.eval_tokens)
        return self.out

    # ---- phases ------------------------------------------------------------------------------
    def _prompts(self):
        rec = self.recipe
        n_held = max(rec.eval_prompts, rec.proxy_prompts)
        if self.record["prompts"] == SELF:  # the target writes them; the bundled held-out set
            train, (_, held, _), name = SELF, bundled_prompts(self.tokenizer, rec.seed), SELF
        elif self.prompt_list is None:
            train, held, name = bundled_prompts(self.tokenizer, rec.seed)
        else:
            check_renderable(self.prompt_list, self.tokenizer)
            (train, held), name = split_heldout(self.prompt_list, n_held), self.record["prompts"]
        self.prompt_source = name
        return train, held

    def _heldout_data(self, ids: list[list[int]]) -> Dataset:
        path = self.work / "data" / "heldout.safetensors"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            seeds = [prompt_seed(self.recipe.seed + 1, i) for i in range(len(ids))]
            save_shard(make_shard(self.generator, self.target, ids, seeds, self.recipe), path)
        return Dataset([load_shard(path)])

    def _data(self, train_ids: Rendered):
        rec = self.recipe
        deadline = None
        if self.clock.budget is not None:
            share = 1.0 if self.record.get("data_only") else rec.data_fraction
            deadline = time.time() + share * self.clock.budget - self.clock.elapsed()
        bar = self._bar(desc="data (prompts)", unit="prompt")
        done = [0]

        def on_shard(meta):
            self.clock.save()
            if bar is not None:
                bar.update(meta["prompts"] - done[0])
                done[0] = meta["prompts"]

        meta = make_data(self.generator, self.target, train_ids, rec, self.work / "data", deadline, on_shard)
        if bar is not None:
            bar.close()
        if not meta["shards"]:
            raise ValueError(
                "no training prompt fits the target's context; raise prompt_tokens or give shorter prompts"
            )
        return Dataset.from_dir(self.work / "data", meta["shards"]), meta

    def _vocab_map(self, data: Dataset):
        """The subset vocabulary (most target mass over all stored rows, special tokens kept)
        and the target's response mass inside it; (None, None) without vocab_subset."""
        k = self.recipe.vocab_subset
        if k is None:
            return None, None
        V = self.target.config.vocab_size
        mass = np.zeros(V)
        kept = data.topk_ids >= 0  # prompt rows not kept are -1
        np.add.at(mass, data.topk_ids[kept], data.topk_probs[kept].astype(np.float64))
        vocab_map = VocabMap(choose_subset(mass, k, list(self.tokenizer.all_special_ids)), V)
        response = data.token_mass(V)
        return vocab_map, round(float(response[vocab_map.ids.numpy()].sum() / response.sum()), 4)

    def _draft_dir(self, i: int) -> Path:
        return self.out if i == 0 else self.out / f"boost_{i + 1}"

    def _draft(self, i: int, data: Dataset, vocab_map, weights):
        rec = self.recipe
        draft = build_draft(self.target, rec, vocab_map, seed=rec.seed + i).to(rec.device)
        until = None
        if self.clock.budget is not None:
            until = self.clock.elapsed() + (self.clock.budget - self.clock.elapsed()) / (rec.drafts - i)
        job = Job(
            n_sequences=len(data), recipe=rec, loss=draft_loss(draft, data, vocab_map, rec, weights),
            index=i, checkpoint=self.work / f"draft_{i + 1}.pt", clock=self.clock, until=until,
            evaluate=lambda model, step, loss: self._evaluate(i, model, vocab_map, step, loss),
            progress=self._bar,
        )  # fmt: skip
        summary = train_model(draft, job)
        directory = self._draft_dir(i)
        save_draft(draft, directory, self.target, self.tokenizer, vocab_map, rec.save_dtype)
        if not any(r["draft"] == i + 1 and r.get("final") for r in read_jsonl(self.eval_path)):
            saved, saved_map = load_draft(directory, device=rec.device)
            self._evaluate(i, saved, saved_map, summary["steps"], None, final=True)
        rows = [r for r in read_jsonl(self.eval_path) if r["draft"] == i + 1]
        summary.update(
            dir=str(directory.relative_to(self.out)) if i else ".",
            eval_init=rows[0],
            eval_final=next(r for r in rows if r.get("final")),
        )
        return draft, summary

    def _evaluate(self, i: int, model, vocab_map, step: int, loss, final: bool = False) -> dict:
        t0 = time.time()
        frozen = copy.deepcopy(model).eval().requires_grad_(False)
        with torch.no_grad(), self.clock.paused():
            record = {
                "draft": i + 1,
                "step": step,
                "final": final,
                "elapsed_s": round(self.clock.elapsed(), 1),
                "loss": None if loss is None else round(loss, 4),
                "proxy": proxy(frozen, self.heldout, vocab_map),
                **acceptance(
                    self.target_runner,
                    self.tokenizer,
                    draft_runner(frozen, vocab_map),
                    self.eval_ids,
                    self.recipe.eval_tokens,
                ),
            }
        record["eval_seconds"] = round(time.time() - t0, 2)
        with self.eval_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        return record

    def _prune_eval_log(self) -> None:
        """Drop evaluations a resumed run will redo: past each draft's last checkpoint."""
        rows = read_jsonl(self.eval_path)
        if not rows:
            return
        last = {}
        for i in range(self.recipe.drafts):
            path = self.work / f"draft_{i + 1}.pt"
            last[i + 1] = torch.load(path, weights_only=False)["step"] if path.is_file() else -1
        keep = [
            r
            for r in rows
            if r["step"] <= last[r["draft"]]
            and (not r["final"] or (self._draft_dir(r["draft"] - 1) / "config.json").is_file())
        ]
        self.eval_path.write_text("".join(json.dumps(r) + "\n" for r in keep))

    def _bar(self, **kwargs):
        if not self.recipe.progress:
            return None
        from tqdm.auto import tqdm

        return tqdm(**kwargs)

    def _write_summary(self, data: Dataset, meta: dict, coverage, summaries: list[dict], merged) -> None:
        response = data.response_rows()
        summary = {
            "target": self.record["target"],
            "prompts": self.prompt_source,
            "minutes": self.minutes,
            "recipe": self.recipe.as_dict(),
            "data": {
                "from": self.record.get("data_from"),
                "train_prompts": meta["prompts"],
                "shards": meta["shards"],
                "seconds": meta["seconds"],
                "stored_positions": int(data.n_rows),
                "response_positions": int(response.sum()),
                "prompt_positions": int((~response).sum()),
                "heldout_prompts": len(self.heldout),
                "eval_prompts": len(self.eval_ids),
            },
            "vocab_subset": None
            if coverage is None
            else {"k": self.recipe.vocab_subset, "response_mass_inside": coverage},
            "drafts": summaries,
            "merged": merged,
            "budget_seconds": round(self.clock.elapsed(), 1),  # data + training (the --minutes clock)
            "eval_seconds": round(sum(r["eval_seconds"] for r in read_jsonl(self.eval_path)), 1),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        }
        (self.out / "distill.json").write_text(json.dumps(summary, indent=1) + "\n")


def choose_subset(token_mass: np.ndarray, k: int, always: list[int]) -> list[int]:
    """The `k` ids with the most target probability mass (`token_mass` [V]), `always` included;
    in id order."""
    if k < len(set(always)):
        raise ValueError(
            f"vocab_subset {k} is smaller than the {len(set(always))} special tokens it must keep"
        )
    order = np.argsort(-token_mass, kind="stable")
    chosen = list(dict.fromkeys([int(i) for i in always] + [int(i) for i in order]))[:k]
    return sorted(chosen)
