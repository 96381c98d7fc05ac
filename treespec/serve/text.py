"""A request's text as it streams: incremental decoding and OpenAI's stop semantics.

The engine ends a request at the token that completes a stop string and keeps that token
(Hugging Face's semantics, `treespec.output.StopMatcher`). OpenAI's API returns the text
*before* the stop string, and a stream never shows any part of it. So the whole generated
sequence is decoded after each round and only text that can no longer change is released:
not a trailing incomplete character ("\\ufffd" while a multi-byte character is split across
tokens), and not a tail that could still be the start of a stop string. At the end the text is
cut at the first stop string and the rest released. The concatenated stream is therefore
exactly the non-streamed text.
"""

from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.ids: list[int] = []
        self.shown = ""  # text released so far

    def feed(self, ids: Sequence[int]) -> str:
        """Add a round's tokens; the new text that is safe to show (may be empty)."""
        self.ids.extend(ids)
        text = self._decode(self.ids).rstrip("\ufffd")  # a character still being spelled out
        cut = first_stop(text, self.stops)
        text = text[: len(text) - stop_prefix_len(text, self.stops)] if cut is None else text[:cut]
        return self._release(text)

    def finish(self, token_ids: Sequence[int]) -> str:
        """The request is over with these tokens (all of them); the rest of the text."""
        self.ids = list(token_ids)
        return self._release(self.text)

    @property
    def text(self) -> str:
        """The final text of the tokens so far: decoded, cut before the first stop string."""
        text = self._decode(self.ids)
        cut = first_stop(text, self.stops)
        return text if cut is None else text[:cut]

    def _release(self, text: str) -> str:
        if len(text) <= len(self.shown) or not text.startswith(self.shown):
            return ""
        new, self.shown = text[len(self.shown) :], text
        return new

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string in `text` begins (None if there is none)."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """The longest tail of `text` that is a proper prefix of a stop string (it may still
    become one), 0 if none."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
