"""Streamed text: the same as decoding everything, held back while a UTF-8 character is incomplete, and in work
proportional to the new tokens."""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer

from specdecode.detokenize import INCOMPLETE, IncrementalText


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a byte-level BPE vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_level_tokenizer() -> Qwen2Tokenizer:
    """Byte-level BPE with ASCII letters and space, words, and the bytes of multi-byte characters as tokens of
    their own (é, €, an emoji: 2, 3 and 4 bytes), so characters split across tokens."""
    to_char = bytes_to_unicode()
    pieces = [to_char[b] for b in b" abcdefgh.,"] + ["\u0120hello", "\u0120world", "\u0120."]
    for ch in "é€😀":
        pieces += [to_char[b] for b in ch.encode()]
    pieces.append("".join(to_char[b] for b in "é".encode()))  # é as one token too
    vocab = {p: i for i, p in enumerate(dict.fromkeys(pieces))}
    return Qwen2Tokenizer(vocab=vocab, merges=[])


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """SentencePiece-style pieces: a decode drops the leading space of its first piece (Llama, Mistral)."""
    vocab = {p: i for i, p in enumerate(["<unk>", "\u2581Hello", "\u2581world", "\u2581again", ",", "!", "\u2581"])}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def stream(tokenizer, ids: list[int]) -> IncrementalText:
    text = IncrementalText(tokenizer)
    for n in range(1, len(ids) + 1):
        before = text.text
        text.update(ids[:n])
        full = tokenizer.decode(ids[:n], skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert text.text.startswith(before) and full.startswith(text.text), (ids[:n], text.text, full)
        assert not text.text.endswith(INCOMPLETE)
    text.update(ids, final=True)
    return text


def test_streamed_text_is_the_full_decode():
    for tokenizer in (byte_level_tokenizer(), metaspace_tokenizer()):
        rng = random.Random(0)
        for _ in range(200):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 30))]
            want = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            assert stream(tokenizer, ids).text == want, ids


def test_clean_up_of_spaces_is_off_so_streamed_text_never_changes():
    class CleaningUp:  # transformers 4 applied a config's clean_up_tokenization_spaces (Llama 3's: true) to BPE too
        def __init__(self, tok):
            self.tok = tok

        def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=True):
            text = self.tok.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
            return text.replace(" .", ".") if clean_up_tokenization_spaces else text

    tok = byte_level_tokenizer()
    ids = tok.convert_tokens_to_ids(["a", "\u0120", ".", "b", "\u0120hello", "\u0120."])
    text = IncrementalText(CleaningUp(tok))
    for n in range(1, len(ids) + 1):
        before = text.text
        text.update(ids[:n])
        assert text.text.startswith(before)  # a clean-up would have rewritten "a " into "a." after the fact
    assert text.text == "a .b hello ."


def test_an_incomplete_character_waits_for_its_last_byte():
    tok = byte_level_tokenizer()
    to_char = bytes_to_unicode()
    ids = [tok.convert_tokens_to_ids(to_char[b]) for b in "😀".encode()]
    text = IncrementalText(tok)
    for n in range(1, 4):
        text.update(ids[:n])
        assert text.text == ""  # three of the emoji's four bytes: nothing to show yet
    text.update(ids)
    assert text.text == "😀"


def test_each_update_decodes_a_window_not_everything():
    tok = byte_level_tokenizer()
    decoded = []

    class Counting:
        def decode(self, ids, **options):
            decoded.append(len(ids))
            return tok.decode(ids, **options)

    rng = random.Random(1)
    ids = [rng.randrange(len(tok)) for _ in range(2000)]  # split characters and special tokens among them
    text = IncrementalText(Counting())
    for n in range(1, len(ids) + 1):
        text.update(ids[:n])
    text.update(ids, final=True)
    assert text.text == tok.decode(ids, skip_special_tokens=True)
    assert sum(decoded) < 10 * len(ids)  # a full decode per token would be about 2000 * 2000 / 2
