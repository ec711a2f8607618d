"""Incremental detokenization with stop strings, one instance per request, run in the front end."""

from __future__ import annotations

from dpserve.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding a window that starts a few tokens back keeps the spacing right for tokenizers whose
    output depends on the previous token; text that ends in an incomplete UTF-8 character is held
    until the next token completes it. Text that could still become a stop string is held back
    too, so a client never sees (part of) a stop string. The request's parameters say whether
    special tokens are skipped (and spaced, for tokenizers that support it), whether the matched
    stop string stays at the end of the text (`no_stop_trim`), and how many tokens come before stop
    strings are looked for (`min_new_tokens`).
    """

    def __init__(self, tokenizer, stop: list[str], params: SamplingParams | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.params = params or SamplingParams()
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of `text` already handed out
        self.matched_stop: str | None = None
        self._prefix = 0  # token offsets of the decode window
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        p = self.params
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens,
        )

    def add(self, tokens: list[int]) -> None:
        """Appends tokens; sets `matched_stop` and truncates the text when a stop string appears."""
        for tok in tokens:
            if self.matched_stop is not None:
                return
            self.ids.append(tok)
            before = self._decode(self.ids[self._prefix : self._read])
            after = self._decode(self.ids[self._prefix :])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self.text += after[len(before) :]
                self._prefix, self._read = self._read, len(self.ids)
                if len(self.ids) >= self.params.min_new_tokens:
                    self._check_stop(len(after) - len(before))

    def _check_stop(self, added: int) -> None:
        longest = max((len(s) for s in self.stop), default=0)
        start = max(0, len(self.text) - added - longest + 1)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if hits:
            pos, stop = min(hits)
            end = pos + len(stop) if self.params.no_stop_trim else pos
            self.text, self.matched_stop = self.text[:end], stop

    def delta(self, final: bool) -> str:
        """The text not handed out yet; when not final, minus a tail that may start a stop string."""
        if final and self.matched_stop is None and self._read < len(self.ids):
            # Whatever is left (an incomplete character decodes to U+FFFD, as transformers does).
            before = self._decode(self.ids[self._prefix : self._read])
            self.text += self._decode(self.ids[self._prefix :])[len(before) :]
            self._prefix = self._read = len(self.ids)
        end = len(self.text)
        if not final:
            end -= self._stop_prefix_len()
        out = self.text[self.sent : max(end, self.sent)]
        self.sent += len(out)
        return out

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
