"""A byte-level tokenizer built in code: no files, no hub.

    >>> tok = byte_tokenizer()
    >>> tok.encode("hé")            # token id == UTF-8 byte value
    [104, 195, 169]
    >>> tok.decode([104, 195, 169, EOS_ID], skip_special_tokens=True)
    'hé'

A BPE model with no merges over the 256 ``ByteLevel`` symbols, so every byte
is one token and every string round-trips; ids 256..258 are pad, bos, eos.
This is the vocabulary of the ``tiny`` presets (vocab 259).

A local weights folder that ships its own tokenizer (``tokenizer.json`` or
``tokenizer_config.json``) is read with that tokenizer instead, from the folder
only (never the hub); preset and random models keep the byte tokenizer:

    >>> codec_for(None).encode("hi"), codec_for(None).eos_id
    ([104, 105], 258)
"""

from __future__ import annotations

import functools
from pathlib import Path

PAD_ID, BOS_ID, EOS_ID = 256, 257, 258
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


def decode(ids, special: bool = False) -> str:
    """Text of ``ids`` with special tokens dropped (``special``: written by name);
    invalid UTF-8 becomes U+FFFD."""
    if not special:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")
    names = {v: k for k, v in SPECIALS.items()}
    out, run = [], bytearray()
    for i in ids:
        if int(i) < 256:
            run.append(int(i))
            continue
        out.append(run.decode("utf-8", errors="replace"))
        run = bytearray()
        out.append(names.get(int(i), ""))
    return "".join(out) + run.decode("utf-8", errors="replace")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class Codec:
    """Text <-> token ids for one model: its own tokenizer, or the byte tokenizer."""

    def __init__(self, tokenizer=None) -> None:
        # Use codec_for; tokenizer None means the byte tokenizer.
        self.tokenizer = tokenizer
        if tokenizer is None:
            self.bos_id, self.eos_id = BOS_ID, EOS_ID
        else:
            self.bos_id, self.eos_id = tokenizer.bos_token_id, tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            return encode(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_plain(self, text: str) -> list[int]:
        """``text`` as plain text: a special token's name in it (``<|im_end|>``, ``<eos>``)
        is its characters, never the token (a tool's output cannot end a turn, or open a
        system message, by printing one)."""
        tok = self.tokenizer if self.tokenizer is not None else byte_tokenizer()
        return list(tok.encode(text, add_special_tokens=False, split_special_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    def prompt(self, prompt, max_len: int, template=None, truncation=None) -> list[int]:
        """A prompt's tokens, at most ``max_len``: a longer one is refused
        (:class:`PromptTooLong`, ``truncation`` error) or cut to its last (left, the
        default) or first (right) ``max_len`` tokens -- raw text keeps its BOS token.

        Text is encoded as it is, after the BOS token when the tokenizer has one (template
        ``raw``, or ``auto`` without a chat template); chat messages, or text under
        ``chat`` (``auto`` with a chat template), are rendered by the tokenizer's chat
        template (``apply_chat_template``, with the generation prompt; text becomes one
        user message).
        """
        from rpeg.spec.training import Truncation

        head, ids = self._prompt(prompt, template)
        if len(head) + len(ids) <= max_len:
            return head + ids
        truncation = truncation or Truncation.LEFT
        if truncation is Truncation.ERROR:
            raise PromptTooLong(len(head) + len(ids), max_len)
        keep = max_len - len(head)
        return head + (ids[-keep:] if truncation is Truncation.LEFT else ids[:keep])

    def _prompt(self, prompt, template) -> tuple[list[int], list[int]]:
        """(the BOS token kept in front of raw text, the rest of the prompt's tokens)."""
        from rpeg.errors import BackendError
        from rpeg.spec.training import Template

        template = template or Template.RAW
        chat = template is Template.CHAT or (template is Template.AUTO
                                             and self.has_chat_template)
        if chat:
            if not self.has_chat_template:
                raise BackendError("template = chat needs a tokenizer with a chat template, and "
                                   "this model's has none", hint="use template = raw, or a "
                                   "model folder whose tokenizer_config.json or "
                                   "chat_template.jinja carries one")
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) \
                else prompt
            return [], self.chat(messages)
        if not isinstance(prompt, str):
            raise BackendError("a prompt given as chat messages needs the chat template, and "
                               f"the template is {template.value}" + (
                                   " (this tokenizer has no chat template)"
                                   if not self.has_chat_template else ""),
                               hint="give text prompts, or use a model whose tokenizer has a "
                                    "chat template")
        head = [] if self.bos_id is None else [self.bos_id]
        return head, self.encode(prompt)

    def chat(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` rendered by the chat template, ready for the reply."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids, special: bool = False) -> str:
        """Text of ``ids``; special tokens dropped, or (``special``) written out, as a
        tool-call format reads them."""
        if self.tokenizer is None:
            return decode(ids, special)
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=not special)


class PromptTooLong(Exception):
    """A prompt over the workload's prompt_len where truncation = error."""

    def __init__(self, tokens: int, max_len: int) -> None:
        super().__init__(f"the prompt is {tokens} tokens, and prompt_len is {max_len}")
        self.tokens, self.max_len = tokens, max_len


@functools.lru_cache(maxsize=8)
def codec_for(weights: str | None) -> Codec:
    """The codec of a model loaded from ``weights`` (a local folder), or of a preset model."""
    if not weights or not any((Path(weights) / f).is_file() for f in TOKENIZER_FILES):
        return Codec()
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(weights)
    if (path / "tokenizer.json").is_file():
        tok = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    else:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return Codec(tok)


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
