"""A request as data: what to generate, checked once, before anything runs.

`Request` is frozen and validates itself: every field a front end (the Python API, the CLI, a
server) can fill, with messages that name the field. What only the models can tell (the
vocabulary, the context length, whether a draft model exists) is checked by the `Engine` when
the request is added. `make_request` builds one from what users type: text, a chat or token
ids, and stop strings or ids in any mix.

Which verification rule a request runs is `treespec.rules`'s decision (the engine asks it when
the request is added); here `verification` is only checked and "auto" read as None.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .config import SamplingConfig, TreeConfig, check_positive_int
from .constraints import Constraint, constraint_from
from .output import OnTokens, TokenLogprobs
from .rng import Rng
from .rules import rule_name

if TYPE_CHECKING:
    from .trace import RoundTrace

ROLES = ("system", "user", "assistant", "tool")
# Stop strings a request may carry, and their length in characters. Every emitted token is
# checked against them (`treespec.output.StopMatcher`: one automaton over the tail that can
# hold one, so the cost grows with the longest, not the count) and a stream holds back a tail
# as long as the longest; OpenAI allows 4, and no real use needs a list in the hundreds
# (a 1.2 MB list of 100,000 slowed every other request's rounds 5x).
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256


@dataclass(frozen=True)
class Request:
    """One generation request. Token ids only: text and chats become ids in `make_request`."""

    prompt: tuple[int, ...]  # token ids, at least one
    max_new_tokens: int = 128  # the most tokens to generate
    tree: TreeConfig | None = TreeConfig()  # the draft tree; None = plain decoding
    sampling: SamplingConfig = SamplingConfig()  # transforms applied to p and q alike
    seed: int | None = None  # in [0, 2**64); None = a random seed
    stop_strings: tuple[str, ...] = ()  # end after the token that completes one (kept)
    stop_token_ids: tuple[int, ...] = ()  # end at one of these tokens (kept), like EOS
    verification: str | None = None  # "token", "block", "traversal"; None or "auto" = the best that applies
    ignore_eos: bool = False  # generate past EOS, up to max_new_tokens
    trace: bool = False  # record every round (GenerationOutput.trace)
    logprobs: int | None = None  # the target's log p of each generated token and its top-k (None: none)
    on_tokens: OnTokens | None = None  # called with each round's new tokens and their sources
    on_logprobs: Callable[[TokenLogprobs], None] | None = None  # then with those tokens' logprobs
    on_round: Callable[[RoundTrace], None] | None = None  # then with each round's trace (needs trace)
    rng: Rng | None = None  # replaces the seeded TorchRng (the enumeration tests drive every coin)
    # the output must match it (treespec.constraints: a JSON schema, a regex, a choice, a grammar;
    # a dict or a pydantic model class is read by `constraint_from`); None: unconstrained
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", token_ids(self.prompt))
        if not self.prompt:
            raise ValueError("the prompt is empty; give at least one token")
        check_positive_int("max_new_tokens", self.max_new_tokens)
        if self.tree is not None and not isinstance(self.tree, TreeConfig):
            raise ValueError(f"tree must be a TreeConfig or None, got {type(self.tree).__name__}")
        if not isinstance(self.sampling, SamplingConfig):
            raise ValueError(f"sampling must be a SamplingConfig, got {type(self.sampling).__name__}")
        check_seed(self.seed)
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"stop strings must be non-empty str, got {self.stop_strings!r}")
        check_stop_strings(self.stop_strings)
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop token ids must be ints >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "verification", rule_name(self.verification))  # "auto" is None
        object.__setattr__(self, "constraint", constraint_from(self.constraint))
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            raise ValueError(
                f"logprobs must be None or an integer >= 0 (how many of the most likely tokens to "
                f"report per position), got {self.logprobs!r}"
            )
        for name in ("ignore_eos", "trace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.on_tokens is not None and not callable(self.on_tokens):
            raise ValueError(
                f"on_tokens must be a function (ids, sources) -> None, got {type(self.on_tokens).__name__}"
            )
        if self.on_logprobs is not None and (not callable(self.on_logprobs) or self.logprobs is None):
            raise ValueError("on_logprobs must be a function (TokenLogprobs) -> None, and needs logprobs=k")
        if self.on_round is not None and (not callable(self.on_round) or not self.trace):
            raise ValueError("on_round must be a function (RoundTrace) -> None, and needs trace=True")
        if self.rng is not None and not isinstance(self.rng, Rng):
            raise ValueError(
                f"rng must be a treespec.rng.Rng, got {type(self.rng).__name__}; pass seed= for a seeded run"
            )

    @property
    def slots(self) -> int:
        """KV cache slots the request may need: prompt + max_new_tokens + its deepest tree."""
        return len(self.prompt) + self.max_new_tokens + (0 if self.tree is None else self.tree.max_depth)


def make_request(prompt, tokenizer=None, stop=None, **settings) -> Request:
    """A `Request` from what a user passes: `prompt` as text, a chat (a list of {"role",
    "content"} messages, rendered with the tokenizer's chat template) or token ids; `stop` as a
    string, a token id or a list of them; the other `Request` fields by name."""
    unknown = set(settings) - set(Request.__dataclass_fields__) - {"prompt"}
    if unknown:
        fields = ", ".join(f for f in Request.__dataclass_fields__ if not f.startswith("stop_"))
        raise ValueError(f"unknown setting(s) {', '.join(sorted(unknown))}; the settings are {fields}, stop")
    strings, ids = parse_stop(stop)
    if strings and tokenizer is None:
        raise ValueError(
            "stop strings need a tokenizer to decode the output; pass tokenizer=... or stop token ids"
        )
    return Request(encode_prompt(prompt, tokenizer), stop_strings=strings, stop_token_ids=ids, **settings)


def encode_prompt(prompt, tokenizer=None) -> tuple[int, ...]:
    """`prompt` as token ids: text is tokenized, a chat rendered with the chat template (the
    generation prompt added, as `apply_chat_template(..., add_generation_prompt=True)`), token
    ids checked. Anything else is refused, never converted."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass tokenizer=... or a list of token ids")
        if not prompt:
            raise ValueError("the prompt is empty; give at least one token")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the prompt is not valid text: {e.reason} at character {e.start}") from None
        return tuple(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if is_chat(prompt):
        return chat_ids(prompt, tokenizer)
    return token_ids(prompt)


def is_chat(prompt) -> bool:
    """A list of messages (mappings), as OpenAI's and Hugging Face's chat APIs take them."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, Mapping) for m in prompt)


def chat_ids(messages: Sequence[Mapping], tokenizer) -> tuple[int, ...]:
    """A chat rendered with `tokenizer`'s chat template, token ids identical to Hugging Face's
    `apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "a chat prompt needs a tokenizer with a chat template; pass the prompt as text instead"
        )
    check_chat(messages)
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=True, tokenize=False
    )
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_chat(messages: Sequence[Mapping]) -> None:
    """Every message a {"role", "content"} mapping with a known role and text content;
    ValueError naming the first that is not ("message i: ...")."""
    for i, m in enumerate(messages):
        if set(m) - {"role", "content", "name"} or not isinstance(m.get("content"), str):
            raise ValueError(
                f"message {i}: give {{'role': ..., 'content': '...'}} with text content, got {dict(m)!r}"
            )
        if m.get("role") not in ROLES:
            raise ValueError(f"message {i}: role must be one of {', '.join(ROLES)}, got {m.get('role')!r}")


def token_ids(prompt) -> tuple[int, ...]:
    """A prompt given as token ids, as a tuple of Python ints; anything else is refused, never
    converted (bytes, floats, bools, strings, dicts and sets are mistakes, not token ids)."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise ValueError("the prompt is bytes; pass text (str) or a list of int token ids")
    if isinstance(prompt, (str, Mapping, set, frozenset)):
        raise ValueError(
            f"the prompt must be text, a chat (a list of messages) or a list of int token ids, "
            f"got a {type(prompt).__name__}"
        )
    if isinstance(prompt, torch.Tensor) or hasattr(prompt, "dtype"):  # a torch or numpy array
        shape, dtype = tuple(prompt.shape), str(prompt.dtype)
        if len(shape) != 1:
            raise ValueError(f"a prompt tensor must be 1-D token ids, got shape {shape}; pass input_ids[0]")
        if isinstance(prompt, torch.Tensor):
            integer = not (
                prompt.dtype.is_floating_point or prompt.dtype.is_complex or prompt.dtype == torch.bool
            )
        else:
            integer = getattr(prompt.dtype, "kind", "") in ("i", "u")
        if not integer:
            raise ValueError(f"prompt token ids must be integers, got an array of {dtype}")
        prompt = prompt.tolist()
    try:
        items = tuple(prompt)
    except TypeError:
        raise ValueError(
            f"the prompt must be text, a chat or a list of int token ids, got {type(prompt).__name__}"
        ) from None
    for t in items:
        if not _is_int(t):
            raise ValueError(
                f"prompt token ids must be ints, got {t!r} ({type(t).__name__}); pass ints "
                f"(not floats, bools or strings), or the prompt as text"
            )
        if t < 0:
            raise ValueError(f"prompt token ids must be >= 0, got {t}")
    return tuple(int(t) for t in items)


def parse_stop(stop) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Stop strings and stop token ids from a string, an id, or a list mixing them."""
    if stop is None:
        return (), ()
    if isinstance(stop, (bytes, bytearray, memoryview)):
        raise ValueError("stop is bytes; pass stop strings as str (or token ids as ints)")
    items = [stop] if isinstance(stop, (str, numbers.Integral)) else stop
    try:
        items = list(items)
    except TypeError:
        raise ValueError(
            f"stop must be a string, a token id or a list of them, got {type(stop).__name__}"
        ) from None
    check_stop_strings([x for x in items if isinstance(x, str)])
    strings, ids = [], []
    for x in items:
        if isinstance(x, str):
            if not x:
                raise ValueError("stop strings must not be empty")
            strings.append(x)
        elif _is_int(x):
            if x < 0:
                raise ValueError(f"stop token id {x} is negative")
            ids.append(int(x))
        else:
            raise ValueError(f"stop entries must be strings or int token ids, got {x!r} ({type(x).__name__})")
    return tuple(strings), tuple(dict.fromkeys(ids))


def check_stop_strings(strings: Sequence[str]) -> None:
    """At most MAX_STOP_STRINGS stop strings of at most MAX_STOP_LENGTH characters each."""
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(
            f"stop: {len(strings)} stop strings, more than the {MAX_STOP_STRINGS} a request may "
            f"give; keep the {MAX_STOP_STRINGS} that matter, or cut the text after it arrives"
        )
    for i, x in enumerate(strings):
        if isinstance(x, str) and len(x) > MAX_STOP_LENGTH:
            raise ValueError(
                f"stop string {i} is {len(x)} characters long, more than the {MAX_STOP_LENGTH} a "
                f"stop string may have; use its first {MAX_STOP_LENGTH} characters"
            )


def check_seed(seed) -> None:
    if seed is None:
        return
    if not _is_int(seed) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be None or an integer in [0, 2**64), got {seed!r}")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)
