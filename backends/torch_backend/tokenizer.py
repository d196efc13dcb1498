"""A byte-level tokenizer built in code: no files, no hub.

    >>> tok = byte_tokenizer()
    >>> tok.encode("hé")            # token id == UTF-8 byte value
    [104, 195, 169]
    >>> tok.decode([104, 195, 169, EOS_ID], skip_special_tokens=True)
    'hé'

A BPE model with no merges over the 256 ``ByteLevel`` symbols, so every byte
is one token and every string round-trips; ids 256..258 are pad, bos, eos.
This is the vocabulary of the ``tiny`` presets (vocab 259).
"""

from __future__ import annotations

import functools

PAD_ID, BOS_ID, EOS_ID = 256, 257, 258
VOCAB_SIZE = 259
SPECIALS = {"<pad>": PAD_ID, "<bos>": BOS_ID, "<eos>": EOS_ID}


@functools.lru_cache(maxsize=1)
def byte_tokenizer():
    """The ``PreTrainedTokenizerFast`` whose token ids are byte values (cached: ~2 ms once)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # ByteLevel maps byte b to a printable symbol; give that symbol the id b.
    symbols = _bytes_to_unicode()
    vocab = {symbols[b]: b for b in range(256)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    # Specials go after the 256 byte symbols, in this order, so their ids are fixed.
    core.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>",
                                  bos_token="<bos>", eos_token="<eos>")
    assert [tok.convert_tokens_to_ids(t) for t in SPECIALS] == list(SPECIALS.values())
    return tok


def encode(text: str) -> list[int]:
    return byte_tokenizer().encode(text, add_special_tokens=False)


def decode(ids) -> str:
    """Text of ``ids`` with special tokens dropped; invalid UTF-8 becomes U+FFFD."""
    return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def _bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-to-symbol table that ``ByteLevel`` uses."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table
