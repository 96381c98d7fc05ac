"""Prompt sets for distillation: the user's file, or a bundled set suited to the target.

A prompt is text (`str`) or a chat (`list` of {"role", "content"} messages). Files:

    .txt    one prompt per line
    .jsonl  one prompt per line: a JSON string, or an object with "prompt", "text",
            "instruction" or "messages"
    .json   a list of such items (a chat conversation: a list of messages, or an object
            with "messages"), or {"prompts": [...]} as in the pycode held-out file

Bundled sets (`bundled_prompts`): a target whose tokenizer has a chat template gets the chat
instructions of `prompts/chat_train.jsonl` (held out: `prompts/chat_heldout.jsonl`, never
trained on; `experiments/build/distill_make_chat_prompts.py` writes both). Any other target gets
line-aligned snippets of the CPython standard library on this machine, without the files the
pycode pair holds out (held out: those files' prompts, `zoo/pycode/heldout_prompts.json`).

Self-written prompts (`prompts="self"`, `SelfPrompts`): the target writes its own (Magpie,
Xu et al. 2024). A chat model is given its chat template up to where a user's text begins and
samples the user's message; a model without a template samples text after its BOS token. The
prompts are then as many and as varied as the data needs, in the target's own domain, with no
file; held out are the bundled held-out prompts suited to the target.

Rendering (`render`): with a chat template, text becomes one user turn and the prompt ends
with the assistant header (`add_generation_prompt=True`); without one, text is tokenized as
the decoder tokenizes prompts.
"""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from pathlib import Path

Prompt = str | list  # text, or a chat: [{"role": ..., "content": ...}, ...]
SELF = "self"  # prompts=SELF: the target writes its own prompts (`SelfPrompts`)

PROMPTS_DIR = Path(__file__).resolve().parent / "prompts"
CHAT_TRAIN = PROMPTS_DIR / "chat_train.jsonl"
CHAT_HELDOUT = PROMPTS_DIR / "chat_heldout.jsonl"
# the pycode pair's split (zoo/pycode/README.md): a stdlib file is held out iff
# int(sha1(relpath)[:8], 16) % 1000 < 20; test directories and site-packages are skipped
HELDOUT_PER_MILLE = 20
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test"}
MAX_FILE_BYTES = 400_000
HELDOUT_SEED = 0  # the held-out draw from a prompt file, whatever the recipe's seed
SNIPPET_LINES = 40  # a stdlib snippet: up to this many lines from a file head or a def/class
_TEXT_KEYS = ("prompt", "text", "instruction")


def load_prompt_file(path: str | Path) -> list[Prompt]:
    """The prompts of a .txt / .jsonl / .json file; ValueError if unreadable or empty."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no prompt file at {str(path)!r}")
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".txt":
            items: list = [line for line in text.splitlines() if line.strip()]
        elif path.suffix == ".jsonl":
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
        elif path.suffix == ".json":
            data = json.loads(text) if text.strip() else []
            items = data["prompts"] if isinstance(data, dict) else data
        else:
            raise ValueError(f"unknown prompt file type {path.suffix!r}; use .txt, .jsonl or .json")
        prompts = [_prompt(item) for item in items]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read prompts from {path}: {str(e).splitlines()[0]}") from None
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


def _prompt(item) -> Prompt:
    if isinstance(item, dict):
        if "messages" in item:
            item = item["messages"]
        else:
            item = next((item[k] for k in _TEXT_KEYS if k in item), None)
    if isinstance(item, str) and item.strip():
        return item
    if (
        isinstance(item, list)
        and item
        and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in item)
    ):
        return _up_to_last_user_turn(item)
    raise TypeError(
        f"a prompt must be non-empty text or a list of role/content messages, got {str(item)[:80]!r}"
    )


def _up_to_last_user_turn(messages: list[dict]) -> list[dict]:
    """A conversation cut after its last user turn (the target writes the reply itself)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last is None:
        raise TypeError("a chat prompt needs at least one user message")
    return [{"role": m["role"], "content": m["content"]} for m in messages[: last + 1]]


def split_heldout(prompts: list[Prompt], n_heldout: int) -> tuple[list[Prompt], list[Prompt]]:
    """(train, held-out): `n_heldout` prompts drawn at random, the rest in file order. The draw
    does not follow the recipe's seed, so runs with other seeds evaluate on the same prompts and
    their data can be trained on together (`distill(data_from=[...])`)."""
    if len(prompts) <= n_heldout:
        raise ValueError(
            f"the prompt file has {len(prompts)} prompts; it needs more than the {n_heldout} held out "
            f"for evaluation (lower eval_prompts / proxy_prompts or add prompts)"
        )
    held = set(random.Random(HELDOUT_SEED).sample(range(len(prompts)), n_heldout))
    return [p for i, p in enumerate(prompts) if i not in held], [prompts[i] for i in sorted(held)]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def bundled_prompts(tokenizer, seed: int) -> tuple[list[Prompt], list[Prompt], str]:
    """(train, held-out, name) of the bundled set suited to the target's tokenizer."""
    if has_chat_template(tokenizer):
        return _jsonl_prompts(CHAT_TRAIN), _jsonl_prompts(CHAT_HELDOUT), "chat"
    from ..zoo import load_prompts

    return stdlib_snippets(seed), load_prompts(), "stdlib"


def _jsonl_prompts(path: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def stdlib_snippets(seed: int) -> list[str]:
    """Line-aligned snippets of this machine's standard library (the pycode training files only):
    each file's head and every def/class with the lines after it, in a seeded random order."""
    snippets = []
    for lines in stdlib_training_files().values():
        starts = [0] + [
            i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class ", "async def "))
        ]
        for s in dict.fromkeys(starts):
            text = "".join(lines[s : s + SNIPPET_LINES])
            if text.strip():
                snippets.append(text)
    random.Random(seed).shuffle(snippets)
    return snippets


def stdlib_training_files() -> dict[str, list[str]]:
    """{relative path: lines} of the stdlib files the pycode pair trains on (its split rule)."""
    from ..zoo import ZOO

    root = Path(sysconfig.get_paths()["stdlib"])
    listed = set(json.loads((ZOO / "pycode" / "heldout_prompts.json").read_text())["heldout_files"])
    files = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]) or _held_out(rel.as_posix(), listed):
            continue
        try:
            if path.stat().st_size <= MAX_FILE_BYTES:
                files[rel.as_posix()] = path.read_bytes().decode("utf-8").splitlines(keepends=True)
        except (OSError, UnicodeDecodeError):
            continue
    return files


def _held_out(rel: str, listed: set[str]) -> bool:
    return rel in listed or int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 1000 < HELDOUT_PER_MILLE


def check_renderable(prompts: list[Prompt], tokenizer) -> None:
    """ValueError if chat prompts meet a tokenizer without a chat template."""
    if not has_chat_template(tokenizer) and any(isinstance(p, list) for p in prompts):
        raise ValueError(
            "the prompt file holds chat conversations but the target's tokenizer has no chat template"
        )


def render(prompt: Prompt, tokenizer, max_tokens: int) -> list[int] | None:
    """Token ids of `prompt` as the target sees it; None for a chat longer than `max_tokens`.
    Longer text is cut at the last line break (or token) that fits."""
    if has_chat_template(tokenizer):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        return ids if len(ids) <= max_tokens else None
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    if len(ids) <= max_tokens:
        return ids
    head = tokenizer.decode(ids[:max_tokens])
    cut = head.rfind("\n")
    if cut <= 0:
        return ids[:max_tokens]
    ids = tokenizer(head[: cut + 1], add_special_tokens=True)["input_ids"]
    return ids[:max_tokens]


class Rendered:
    """Prompts rendered to token ids on demand, in order; prompts that do not fit are skipped
    (the bundled stdlib set has ~30k snippets and a budgeted run uses a few hundred)."""

    def __init__(self, prompts: list[Prompt], tokenizer, max_tokens: int, limit: int | None = None):
        self.prompts, self.tokenizer, self.max_tokens, self.limit = prompts, tokenizer, max_tokens, limit
        self.ids: list[list[int]] = []
        self._next = 0  # index of the next prompt to render

    def take(self, start: int, n: int) -> list[list[int]]:
        """Rendered prompts start .. start + n - 1 (fewer at the end of the set)."""
        end = start + n if self.limit is None else min(start + n, self.limit)
        while len(self.ids) < end and self._next < len(self.prompts):
            ids = render(self.prompts[self._next], self.tokenizer, self.max_tokens)
            self._next += 1
            if ids:
                self.ids.append(ids)
        return self.ids[start:end]


class SelfPrompts:
    """Prompts the target writes itself (Magpie), rendered to token ids, with `Rendered`'s
    `take(start, n)`. Prompt i depends only on (seed, i): it is the first of its attempts
    (sampling seeds `seed`, i, attempt) that a chat model ends with its end of turn within
    `SAMPLE_TOKENS` tokens (fewer where `max_tokens`, the rendered prompt's limit, is short) and
    that holds at least `MIN_WORDS` words, or its last attempt as it was cut; so a resumed run
    writes the same prompts wherever it stopped. Attempts of one `take` are sampled together
    (`generate_batch`, plain decoding at temperature 1)."""

    MIN_WORDS = 3
    ATTEMPTS = 8
    TEMPERATURE = 1.0
    SAMPLE_TOKENS = 96  # the most tokens sampled for one prompt's text

    def __init__(self, generator, tokenizer, seed: int, max_tokens: int, limit: int | None = None):
        self.generator, self.tokenizer, self.seed = generator, tokenizer, seed
        self.max_tokens, self.limit = max_tokens, limit
        self.chat = has_chat_template(tokenizer)
        if self.chat:
            mark = "\x00treespec\x00"
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": mark}], add_generation_prompt=False, tokenize=False
            )
            self.prefix = tokenizer(text[: text.index(mark)], add_special_tokens=False)["input_ids"]
        else:
            bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
            if bos is None:
                raise ValueError("prompts='self' needs a chat template or a BOS token to start text from")
            self.prefix = [bos]
        # room for the template's closing and assistant header within max_tokens
        self.sample_tokens = max(8, min(self.SAMPLE_TOKENS, max_tokens - len(self.prefix) - 16))

    def seed_of(self, index: int, attempt: int) -> int:
        return (self.seed * 1_000_003 + index) * self.ATTEMPTS + attempt + 7_919

    def take(self, start: int, n: int) -> list[list[int]]:
        """Self-written prompts start .. start + n - 1, as token ids the target is prompted with."""
        from ..config import SamplingConfig

        end = start + n if self.limit is None else min(start + n, self.limit)
        prompts: dict[int, list[int]] = {}
        todo = list(range(start, end))
        for attempt in range(self.ATTEMPTS):
            if not todo:
                break
            outs = self.generator.generate_batch(
                [self.prefix] * len(todo),
                max_new_tokens=self.sample_tokens,
                tree=None,
                sampling=SamplingConfig(temperature=self.TEMPERATURE),
                seeds=[self.seed_of(i, attempt) for i in todo],
                max_batch=len(todo),
            )
            for i, out in zip(todo, outs):
                text = out.text.strip()
                ended = out.finish_reason == "eos" or not self.chat  # a user turn must end
                if attempt == self.ATTEMPTS - 1 or (ended and len(text.split()) >= self.MIN_WORDS):
                    # a chat: the text as one user turn; else the sampled text itself
                    if self.chat:  # the text as one user turn
                        prompts[i] = render(text, self.tokenizer, 10**9)
                    else:  # the sampled text itself, without an end-of-sequence token
                        ids = list(out.token_ids)
                        prompts[i] = self.prefix + (ids[:-1] if out.finish_reason == "eos" else ids)
            todo = [i for i in todo if i not in prompts]
        return [prompts[i] for i in range(start, end)]
