"""The text of a growing list of generated tokens, in work proportional to the new tokens, not to all of them."""

from __future__ import annotations

INCOMPLETE = "\ufffd"  # what a decode ends with while a UTF-8 character's bytes are still arriving


class IncrementalText:
    """`text` is what `tokenizer.decode(out, skip_special_tokens=True)` gives, grown one `update` at a time.

    Each update decodes a window: the tokens since the last text was added, plus the ones before them, so the
    tokenizer's rules that look at a token's neighbour (a SentencePiece leading space, clean-up of spaces before
    punctuation) see the same context as in a decode of everything (vLLM's incremental detokenizer does the same).
    A window whose decode ends in an incomplete UTF-8 character waits for the next token; `final` flushes it.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self._prefix = 0  # the window starts here
        self._read = 0  # tokens before this one are in `text`

    def update(self, out: list[int], final: bool = False) -> None:
        if self.tokenizer is None:
            return
        known = self._decode(out[self._prefix:self._read])
        window = self._decode(out[self._prefix:])
        if len(window) > len(known) and (final or not window.endswith(INCOMPLETE)):
            self.text += window[len(known):]
            self._prefix, self._read = self._read, len(out)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
