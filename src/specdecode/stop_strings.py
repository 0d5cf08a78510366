"""Stop strings found in text that grows at its end, in work linear in the new text.

Each stop string runs a Knuth-Morris-Pratt automaton whose state is how much of the string the text ends with;
`feed` advances every automaton over the new characters only. Checking every stop string against the whole text
after each token instead costs the square of a long stop string per token.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdecode.errors import InvalidRequestError


class StopStrings:
    """The first occurrence of any stop string in a text fed piece by piece, and how much of the text's end could
    still begin one (held back from a stream until the next piece decides it)."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise InvalidRequestError("stop strings must not be empty")
        self.stops = tuple(stops)
        self._fallback = [_prefix_function(s) for s in self.stops]
        self._matched = [0] * len(self.stops)  # per stop string: its characters the text fed so far ends with
        self.fed = 0  # characters fed so far

    def feed(self, new: str) -> int | None:
        """Advance over `new`, appended to the text fed so far. Returns where the first stop string to complete
        starts (an index into all the text fed; the longest one where several complete at the same character), or
        None; after a match the state is undefined."""
        for i, ch in enumerate(new if self.stops else ""):
            longest = 0
            for j, s in enumerate(self.stops):
                k, fallback = self._matched[j], self._fallback[j]
                while k and s[k] != ch:
                    k = fallback[k - 1]
                k += s[k] == ch
                if k == len(s):
                    longest = max(longest, k)
                self._matched[j] = k
            if longest:
                return self.fed + i + 1 - longest
        self.fed += len(new)
        return None

    @property
    def held(self) -> int:
        """The length of the longest end of the text fed so far that is the start of a stop string."""
        return max(self._matched, default=0)


def _prefix_function(s: str) -> list[int]:
    """pi[i]: the length of the longest proper prefix of s[:i + 1] that is also its suffix (KMP's failure links)."""
    pi = [0] * len(s)
    for i in range(1, len(s)):
        k = pi[i - 1]
        while k and s[i] != s[k]:
            k = pi[k - 1]
        pi[i] = k + (s[i] == s[k])
    return pi
