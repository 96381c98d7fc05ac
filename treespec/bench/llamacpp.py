"""llama.cpp as a baseline for `treespec bench`: its own binaries, on the same GGUF file and
the same prompts.

    LlamaCpp.find(dir)        the binaries in DIR (DIR, DIR/bin or DIR/build/bin) or, without
                              DIR, on PATH; None where there are none
    LlamaCpp.decode(...)      llama-completion: plain decoding
    LlamaCpp.speculative(...) llama-speculative-simple with a draft GGUF: llama.cpp's own
                              linear speculative decoding
    draft_to_gguf(...)        a treespec draft (a subset-vocabulary one included) as a GGUF
                              file, through the source tree's convert_hf_to_gguf.py
    head_to_gguf(...)         a feature head (EAGLE-3) as a GGUF file, for llama.cpp's own
                              EAGLE-3 speculation (`--spec-type draft-eagle3`)

Each run is one subprocess, so the model loads every time; the rates come from llama.cpp's own
timers, which start after loading: a run's seconds are its prompt evaluation plus its decoding
(and, for plain decoding, its sampling), the span treespec's `generate()` is timed over.
experiments/build/build_llama_cpp.sh builds the binaries from the PyPI source distribution of
llama-cpp-python (its vendored llama.cpp).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

DECODE_BINARY = "llama-completion"
SPECULATIVE_BINARY = "llama-speculative-simple"
CONVERT_SCRIPT = "convert_hf_to_gguf.py"


@dataclass
class LlamaCppRun:
    """One llama.cpp generation, as its own timers report it."""

    tokens: int  # new tokens generated
    seconds: float  # prompt evaluation + decoding (+ sampling), loading excluded
    prompt_tokens: int  # the prompt as llama.cpp tokenized it
    drafted: int | None = None  # speculative only: draft tokens proposed
    accepted: int | None = None  # speculative only: draft tokens accepted

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds


_NUM = r"\s*=\s*([0-9.]+)"


def parse_decode(log: str) -> LlamaCppRun:
    """A llama-completion run from its log: the perf lines of `common_perf_print`."""
    prompt = re.search(r"prompt eval time" + _NUM + r" ms /\s*(\d+) tokens", log)
    decode = re.search(r"[^t] eval time" + _NUM + r" ms /\s*(\d+) runs", log)
    sampling = re.search(r"sampling time" + _NUM + r" ms", log)
    if not (prompt and decode):
        raise RuntimeError("llama.cpp printed no timings (its log ends: " + _tail(log) + ")")
    seconds = (float(prompt[1]) + float(decode[1]) + (float(sampling[1]) if sampling else 0.0)) / 1e3
    # the first new token comes from the prompt's evaluation, each later one from one decode run
    return LlamaCppRun(tokens=int(decode[2]) + 1, seconds=seconds, prompt_tokens=int(prompt[2]))


def parse_speculative(log: str) -> LlamaCppRun:
    """A llama-speculative-simple run from its log: its "encoded"/"decoded" lines and counts."""
    enc = re.search(r"encoded\s+(\d+) tokens in\s+([0-9.]+) seconds", log)
    dec = re.search(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds", log)
    drafted = re.search(r"n_drafted" + r"\s*=\s*(\d+)", log)
    accepted = re.search(r"n_accept" + r"\s*=\s*(\d+)", log)
    if not (enc and dec and drafted and accepted):
        raise RuntimeError("llama.cpp printed no speculative summary (its log ends: " + _tail(log) + ")")
    return LlamaCppRun(
        tokens=int(dec[1]),
        seconds=float(enc[2]) + float(dec[2]),
        prompt_tokens=int(enc[1]),
        drafted=int(drafted[1]),
        accepted=int(accepted[1]),
    )


def _tail(log: str, n: int = 300) -> str:
    return " ".join(log[-n:].split()) or "nothing"


@dataclass
class LlamaCpp:
    """llama.cpp's binaries found on this machine. `threads`: -t for every run (default: torch's
    thread count, what treespec runs with)."""

    decode_binary: Path
    speculative_binary: Path | None  # None where only plain decoding was built
    convert_script: Path | None  # the source tree's convert_hf_to_gguf.py, if found near the binaries
    threads: int | None = None

    @classmethod
    def find(cls, directory: str | os.PathLike | None = None) -> LlamaCpp | None:
        """The binaries in `directory` (itself, its bin/ or build/bin/), or on PATH without one.
        None where llama-completion is not there; a ValueError for a `directory` that does not
        exist or holds none (a user who names a directory means it)."""
        if directory is None:
            found = shutil.which(DECODE_BINARY)
            if found is None:
                return None
            decode = Path(found).resolve()
            spec = shutil.which(SPECULATIVE_BINARY)
            return cls(decode, Path(spec).resolve() if spec else None, _find_convert(decode.parent))
        root = Path(directory).expanduser()
        if not root.is_dir():
            raise ValueError(f"{directory} is not a directory; give llama.cpp's build or source directory")
        for bin_dir in (root, root / "bin", root / "build" / "bin"):
            if (bin_dir / DECODE_BINARY).is_file():
                spec = bin_dir / SPECULATIVE_BINARY
                return cls(bin_dir / DECODE_BINARY, spec if spec.is_file() else None, _find_convert(bin_dir))
        raise ValueError(
            f"no {DECODE_BINARY} in {directory}, its bin/ or build/bin/; build it with "
            "experiments/build/build_llama_cpp.sh (cmake --build build --target llama-completion)"
        )

    def _common(
        self, gguf: Path, prompt: str, max_new_tokens: int, temperature: float, seed: int
    ) -> list[str]:
        threads = str(self.threads or torch.get_num_threads())
        return [
            "-m", str(gguf), "-p", prompt, "-n", str(max_new_tokens), "--ignore-eos",
            "-t", threads, "-tb", threads, "-c", "4096", "--seed", str(seed), "--temp", str(temperature),
            # sample from the target's own distribution: llama.cpp's default chain also applies
            # top-k 40, top-p 0.95 and min-p 0.05, which treespec's defaults do not
            "--top-k", "0", "--top-p", "1", "--min-p", "0",
        ]  # fmt: skip

    def decode(
        self, gguf: Path, prompt: str, max_new_tokens: int, temperature: float = 0.0, seed: int = 0
    ) -> LlamaCppRun:
        """Plain decoding of `max_new_tokens` tokens after `prompt` (text; special tokens such
        as a chat template's are parsed as such)."""
        args = [str(self.decode_binary), *self._common(gguf, prompt, max_new_tokens, temperature, seed)]
        return parse_decode(_run(args + ["-no-cnv", "--no-display-prompt", "--no-warmup"]))

    def speculative(
        self,
        gguf: Path,
        draft_gguf: Path,
        prompt: str,
        max_new_tokens: int,
        draft_max: int,
        temperature: float = 0.0,
        seed: int = 0,
        spec_type: str = "draft-simple",
    ) -> LlamaCppRun:
        """llama.cpp's speculative decoding (`--spec-type draft-simple`, or "draft-eagle3" with a
        feature head converted by `head_to_gguf`): the draft proposes `draft_max` tokens
        greedily (llama.cpp's defaults otherwise: no minimum probability), the target checks the
        chain in one batch and keeps the prefix its own samples agree with."""
        if self.speculative_binary is None:
            raise ValueError(
                f"{SPECULATIVE_BINARY} is not beside {self.decode_binary}; build that target too"
            )
        args = [str(self.speculative_binary), *self._common(gguf, prompt, max_new_tokens, temperature, seed)]
        args += [
            "--spec-type",
            spec_type,
            "-md",
            str(draft_gguf),
            "--spec-draft-n-max",
            str(draft_max),
            "--spec-draft-n-min",
            "0",
        ]
        return parse_speculative(_run(args))


def _find_convert(bin_dir: Path) -> Path | None:
    for d in (bin_dir, *list(bin_dir.parents)[:3]):
        if (d / CONVERT_SCRIPT).is_file():
            return d / CONVERT_SCRIPT
    return None


def _run(args: list[str]) -> str:
    proc = subprocess.run(args, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(args[0]).name} exited with status {proc.returncode}: {_tail(log)}")
    return log


def draft_to_gguf(draft, tokenizer, out_dir: Path, convert_script: Path, vocab_map=None) -> Path:
    """`draft` (an HF causal LM) as out_dir/draft.gguf (f16) for llama.cpp, with the target's
    `tokenizer`. A subset-vocabulary draft (`vocab_map`) becomes a full-vocabulary one whose
    output rows outside the subset are zero: llama.cpp's Llama has no output bias to put -inf
    there, so those tokens get logit 0 instead of probability 0 -- a slightly different q,
    which no verification rule depends on (any q is lossless; llama.cpp drafts greedily)."""
    from ..backends.subset import full_vocabulary_model

    model = draft
    if vocab_map is not None:
        model = full_vocabulary_model(draft, vocab_map)
        with torch.no_grad():
            out = model.get_output_embeddings()
            out.weight[out.bias.isinf()] = 0  # [V, h]: zero rows outside the subset
        plain = torch.nn.Linear(out.in_features, out.out_features, bias=False, dtype=out.weight.dtype)
        plain.weight = out.weight
        model.set_output_embeddings(plain)
    hf_dir = out_dir / "draft-hf"
    model.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    gguf = out_dir / "draft.gguf"
    _run([sys.executable, str(convert_script), str(hf_dir), "--outfile", str(gguf), "--outtype", "f16"])
    return gguf


def head_to_gguf(head_dir: Path, target_dir: Path, out_dir: Path, convert_script: Path) -> Path:
    """A feature head (an EAGLE-3 checkpoint) as out_dir/head.gguf (f16) for llama.cpp's
    `--spec-type draft-eagle3`: its converter reads the taps, the target's tokenizer and sizes
    from `target_dir` (the target's HF directory: `treespec.loading.checkpoint` of its GGUF)."""
    gguf = out_dir / "head.gguf"
    args = [sys.executable, str(convert_script), str(head_dir), "--target-model-dir", str(target_dir)]
    _run(args + ["--outfile", str(gguf), "--outtype", "f16"])
    return gguf


@dataclass
class LlamaCppBench:
    """What `treespec.bench.harness.run_bench` times llama.cpp with: the binaries, the target's GGUF
    file and, for llama.cpp's speculative decoding, the draft's."""

    llama: LlamaCpp
    gguf: Path
    draft_gguf: Path | None = None
    head_gguf: Path | None = None  # a feature head's (`head_to_gguf`): llama.cpp's EAGLE-3

    @property
    def methods(self) -> list[str]:
        return (
            ["llama.cpp"]
            + (["llama.cpp-spec"] if self.draft_gguf is not None else [])
            + (["llama.cpp-eagle3"] if self.head_gguf is not None else [])
        )

    def run(
        self, method: str, prompt: str, max_new_tokens: int, temperature: float, seed: int, draft_max: int
    ) -> LlamaCppRun:
        if method == "llama.cpp":
            return self.llama.decode(self.gguf, prompt, max_new_tokens, temperature, seed)
        eagle = method == "llama.cpp-eagle3"
        return self.llama.speculative(
            self.gguf, self.head_gguf if eagle else self.draft_gguf, prompt, max_new_tokens, draft_max,
            temperature, seed, "draft-eagle3" if eagle else "draft-simple",
        )  # fmt: skip
