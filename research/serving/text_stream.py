"""Detokenized text of a growing token list, released only when final (the engine's
TokenEvent.text increments)."""
from __future__ import annotations

from typing import Sequence


class TextStream:
    """Detokenized increments of a growing token list, with stop strings.

    Text is released only when it is final: never a trailing U+FFFD of an incomplete
    multi-byte character, never a tail that could still become a stop string.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self.ids: list[int] = []
        self.n_emitted = 0  # characters released
        self._text = ""

    def push(self, token: int) -> tuple[str, bool]:
        """Add a token; returns (new final text, True if a stop string completed)."""
        self.ids.append(int(token))
        text = self._text = self.tokenizer.decode(self.ids, skip_special=True)
        hits = [i for i in (text.find(s, self.n_emitted) for s in self.stops) if i >= 0]
        if hits:
            return self._release(min(hits)), True
        safe = len(text.rstrip("\ufffd"))  # an incomplete multi-byte character waits
        hold = 0
        for s in self.stops:  # a tail that may still become a stop string waits
            for k in range(min(len(s) - 1, safe - self.n_emitted), hold, -1):
                if text[safe - k:safe] == s[:k]:
                    hold = k
                    break
        return self._release(safe - hold), False

    def flush(self) -> str:
        """Everything not yet released (the request ended without a stop string)."""
        return self._release(len(self._text))

    def released(self) -> str:
        """The text released so far."""
        return self._text[:self.n_emitted]

    def copy(self) -> TextStream:
        """An independent stream at the same point (the tokenizer is shared)."""
        out = TextStream(self.tokenizer, self.stops)
        out.ids, out.n_emitted, out._text = list(self.ids), self.n_emitted, self._text
        return out

    def _release(self, end: int) -> str:
        if end <= self.n_emitted:
            return ""
        out = self._text[self.n_emitted:end]
        self.n_emitted = end
        return out
