"""How a tool call is written in a policy's turn and how its observation is wrapped, per
format (``generate(..., format = ...)``, :class:`rpeg.spec.kinds.ToolFormat`).

    >>> f = of(ToolFormat.RPEG)
    >>> f.stops(("calc",))
    ('</calc>',)
    >>> f.parse("let me see <calc>6*7</calc>", ("calc",))
    Call(name='calc', arg='6*7')
    >>> f.parse("<calc>6*7", ("calc",))                  # the turn ended inside the call
    Call(name='calc', arg='6*7')
    >>> f.wrap("42", ended_at_eos=False)
    ('<result>', '</result>')
    >>> of(ToolFormat.HERMES).parse('<tool_call>{"name": "calc", "arguments": {"x": 1}}'
    ...                             '</tool_call>', ("calc",))
    Call(name='calc', arg='{"x": 1}')

A turn ends at the end of a response (EOS) or at one of the format's stop strings (a
call's closing tag); the call, if the turn ends with one, is parsed from the turn's text
(special tokens kept). The observation's text goes between the format's prefix and
suffix, each encoded on its own: the policy's tokens are never re-encoded, and the
observation's are whatever the tokenizer makes of these pieces.
"""

from __future__ import annotations

import json
import re

import attrs

from rpeg.spec.kinds import ToolFormat

TRUNCATED = " [...]"
ERROR = "error: "


@attrs.frozen
class Call:
    name: str
    arg: str


class Format:
    """One tool-call format: stop strings, parsing, wrapping."""

    def stops(self, tools: tuple[str, ...]) -> tuple[str, ...]:
        return ()

    def parse(self, text: str, tools: tuple[str, ...]) -> Call | None:
        raise NotImplementedError

    def wrap(self, observation: str, ended_at_eos: bool) -> tuple[str, str]:
        raise NotImplementedError


class Tags(Format):
    """``<NAME>ARGUMENT</NAME>``, answered by ``<result>TEXT</result>``. A turn that ends (at
    end-of-sequence, or its length) inside a call it or the prompt opened closes it: the
    argument is what follows the opening tag."""

    def stops(self, tools):
        return tuple(f"</{t}>" for t in tools)

    def parse(self, text, tools):
        found = None
        for t in tools:
            end = text.rfind(f"</{t}>")
            if end < 0 or not text[end:].rstrip().endswith(f"</{t}>"):
                continue
            start = text.rfind(f"<{t}>", 0, end)
            if start >= 0 and (found is None or end > found[0]):
                found = (end, Call(t, text[start + len(t) + 2:end]))
        return found[1] if found else self._open(text, tools)

    @staticmethod
    def _open(text, tools):
        """A call still open at the end of ``text``: its opening tag is the last tag."""
        last = max(text.rfind("</"), text.rfind("<result>"))
        best = None
        for t in tools:
            at = text.rfind(f"<{t}>")
            if at > last and (best is None or at > best[0]):
                best = (at, Call(t, text[at + len(t) + 2:]))
        return best[1] if best else None

    def wrap(self, observation, ended_at_eos):
        return "<result>", "</result>"


def _json_call(blob: str, tools, key: str = "arguments") -> Call | None:
    try:
        value = json.loads(blob)
    except ValueError:
        return None
    if isinstance(value, list) and value:
        value = value[0]
    if not isinstance(value, dict) or value.get("name") not in tools:
        return None
    args = value.get(key, value.get("arguments", value.get("parameters", {})))
    return Call(value["name"], args if isinstance(args, str) else json.dumps(args))


class Hermes(Format):
    """ChatML tool calls (Qwen2.5, Qwen3, SmolLM, Hermes)."""

    CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>\s*(?:<\|im_end\|>)?\s*$", re.S)

    def stops(self, tools):
        return ("</tool_call>",)

    def parse(self, text, tools):
        at = text.rfind("<tool_call>")           # the last call: not an example before it
        m = self.CALL.search(text, at) if at >= 0 else None
        return _json_call(m.group(1), tools) if m else None

    def wrap(self, observation, ended_at_eos):
        head = "" if ended_at_eos else "<|im_end|>"
        return (head + "\n<|im_start|>user\n<tool_response>\n",
                "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


class Llama3(Format):
    """Llama 3.1-3.3 JSON tool calls, answered in an ``ipython`` turn."""

    def stops(self, tools):
        return ("<|eom_id|>",)

    def parse(self, text, tools):
        body = text.replace("<|python_tag|>", "")
        for end in ("<|eom_id|>", "<|eot_id|>"):
            body = body.replace(end, "")
        body = body.strip()
        start = body.find("{")
        return _json_call(body[start:], tools, "parameters") if start >= 0 else None

    def wrap(self, observation, ended_at_eos):
        head = "" if ended_at_eos else "<|eot_id|>"
        return (head + "<|start_header_id|>ipython<|end_header_id|>\n\n",
                "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


class Mistral(Format):
    """``[TOOL_CALLS][{...}]``, answered by ``[TOOL_RESULTS]...[/TOOL_RESULTS]``."""

    def parse(self, text, tools):
        at = text.rfind("[TOOL_CALLS]")
        if at < 0:
            return None
        body = text[at + len("[TOOL_CALLS]"):].replace("</s>", "").strip()
        return _json_call(body, tools)

    def wrap(self, observation, ended_at_eos):
        return '[TOOL_RESULTS]{"content": ', "}[/TOOL_RESULTS]"


_FORMATS = {ToolFormat.RPEG: Tags(), ToolFormat.HERMES: Hermes(), ToolFormat.LLAMA3: Llama3(),
            ToolFormat.MISTRAL: Mistral()}


def of(fmt: ToolFormat) -> Format:
    return _FORMATS[ToolFormat(fmt)]


_SURROGATE = re.compile("[\ud800-\udfff]")


def observation_text(fmt: ToolFormat, ok: bool, text: str, error: str) -> str:
    """What the policy sees of an outcome: the tool's text, or the error (the mistral format
    carries it as a JSON string)."""
    body = text if ok else ERROR + error
    # text a tool decoded with surrogateescape (file names, a process's output) holds lone
    # surrogates no tokenizer encodes: each becomes U+FFFD, as a decoder with "replace" does
    body = _SURROGATE.sub("\ufffd", body)
    return json.dumps(body) if ToolFormat(fmt) is ToolFormat.MISTRAL else body


__all__ = ["Call", "ERROR", "Format", "TRUNCATED", "observation_text", "of"]
