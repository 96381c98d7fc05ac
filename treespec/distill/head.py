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

The features are `treespec.distill.features`'s; the model and its loss `treespec.distill.head_model`'s.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..backends.head import default_taps
from .data import Dataset, load_shard
from .evaluate import read_jsonl
from .features import Features, FeatureSet, FeaturesInMemory, compute_features
from .head_model import HeadModel, head_batch, head_loss, head_proxy, init_head, start_from_head
from .recipe import check_known
from .train import Clock, Job, train_model


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
        from ..backends.head import load_head_runner
        from ..decoder import SpeculativeDecoder
        from ..planning import write_acceptance

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
