"""N-gram (prompt lookup) drafts: no draft model, the continuation of an earlier occurrence of the suffix."""

from __future__ import annotations


def propose_ngram(tokens: list[int], num_draft: int, max_match: int = 4, min_match: int = 1) -> list[int]:
    """Propose up to ``num_draft`` tokens by prompt lookup over ``tokens`` (prompt + output so far).

    For ``k`` from ``max_match`` down to ``min_match``: find the latest earlier occurrence of the last ``k``
    tokens (an occurrence ending before the suffix itself ends; it may overlap the suffix) and return the
    tokens that followed it, at most ``num_draft`` (fewer if the sequence ends first). A longer match is
    preferred over a later one. Returns ``[]`` when no suffix of length ``min_match..max_match`` recurs.

    Cost: one backward scan per ``k`` over the sequence, O(len(tokens) * max_match) worst case; a scan
    compares the last token first, so it is a few microseconds per thousand tokens in practice.
    """
    n = len(tokens)
    if num_draft <= 0 or n < 2:
        return []
    min_match = max(1, min_match)
    for k in range(min(max_match, n - 1), min_match - 1, -1):
        suffix = tokens[n - k :]
        last = suffix[-1]
        # ``end`` is the index just past a candidate occurrence; it must be < n (not the suffix itself).
        end = n - 1
        while end >= k:
            # Find the latest position < end whose token equals the suffix's last token.
            try:
                j = _rindex(tokens, last, k - 1, end)
            except ValueError:
                break
            if tokens[j - k + 1 : j + 1] == suffix:
                return tokens[j + 1 : j + 1 + num_draft]
            end = j
    return []


def _rindex(tokens: list[int], value: int, lo: int, hi: int) -> int:
    """The largest index ``i`` with ``lo <= i < hi`` and ``tokens[i] == value``; ValueError if none."""
    for i in range(hi - 1, lo - 1, -1):
        if tokens[i] == value:
            return i
    raise ValueError(value)
