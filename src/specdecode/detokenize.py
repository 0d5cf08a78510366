"""The text of a growing list of generated tokens, in work proportional to the new tokens, not to all of them."""

from __future__ import annotations

INCOMPLETE = "\ufffd"  # what a decode ends with while a UTF-8 character's bytes are still arriving (or a real U+FFFD)


class IncrementalText:
    """`text` is what `tokenizer.decode(out, skip_special_tokens=True, clean_up_tokenization_spaces=False)` gives,
    grown one `update` at a time.

    Each update decodes a window: the tokens added at the previous update that added text, then the new ones, so
    the tokenizer's rules that look at a token's left neighbour (a SentencePiece leading space) see the same
    context as in a decode of everything (as vLLM's incremental detokenizer does). Clean-up of spaces before
    punctuation is off: it would rewrite text already streamed (transformers 5 turns it off for BPE tokenizers
    itself). A window whose decode ends in U+FFFD waits for the next token (an incomplete character, or a real
    U+FFFD: held back until the next token or `final`), and the window grows meanwhile. Known limit: byte-fallback
    decoders (Llama 2, Mistral) that replace a run of invalid bytes as a whole can give a different string than one
    decode of everything when the output ends mid-character or holds invalid UTF-8.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self._prefix = 0  # the window starts here: the tokens of the previous update that added text
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
        if not ids:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
