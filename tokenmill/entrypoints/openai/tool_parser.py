"""Parses Hermes/Qwen `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks out of
generated text into OpenAI `tool_calls`, incrementally: `feed` takes each new piece of text and
returns OpenAI-shaped deltas (content outside the calls; per call a first delta with its id, type,
name and empty arguments, then argument fragments). The argument fragments of a call concatenate
to the call's arguments exactly as the model wrote them. Non-streaming responses run the same
parser over the whole text (`parse`).
"""

from __future__ import annotations

import json
import re
import uuid

from tokenmill.entrypoints.openai.tools import CALL_BEGIN, CALL_END

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_TRAILING = " \t\r\n}"


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallParser:
    def __init__(self):
        self.calls: list[dict] = []  # complete view: {"id", "type", "function": {"name", "arguments"}}
        self.content: list[str] = []
        self._buf = ""  # unconsumed text
        self._in_call = False
        self._call = ""  # text of the open call after <tool_call>
        self._header_end = -1  # offset of the arguments in _call, once the name is known
        self._sent = 0  # argument characters already sent
        self._space = ""  # whitespace held back: sent only if more content follows
        self._content_sent = False

    def feed(self, text: str) -> list[dict]:
        self._buf += text
        deltas: list[dict] = []
        while self._buf:
            if not self._in_call:
                i = self._buf.find(CALL_BEGIN)
                if i < 0:
                    keep = _partial_suffix(self._buf, CALL_BEGIN)
                    self._emit_content(self._buf[:len(self._buf) - keep], deltas)
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                self._emit_content(self._buf[:i], deltas)
                self._buf = self._buf[i + len(CALL_BEGIN):]
                self._in_call, self._call, self._header_end, self._sent = True, "", -1, 0
                continue
            j = self._buf.find(CALL_END)
            if j < 0:
                keep = _partial_suffix(self._buf, CALL_END)
                self._call += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                self._stream_arguments(deltas, final=False)
                break
            self._call += self._buf[:j]
            self._buf = self._buf[j + len(CALL_END):]
            self._close_call(deltas)
        return deltas

    def finish(self) -> list[dict]:
        """At the end of the output: what is still held back (a cut-off call stays as sent)."""
        deltas: list[dict] = []
        if self._in_call:
            if self._header_end < 0:  # never looked like a call: it is text
                self._emit_content(CALL_BEGIN + self._call + self._buf, deltas)
            else:
                self._call += self._buf
                self._stream_arguments(deltas, final=True)
        else:
            self._emit_content(self._buf, deltas)
        self._buf, self._in_call = "", False
        return deltas

    def parse(self, text: str) -> tuple[str | None, list[dict]]:
        """Whole-text parse: (content or None, tool_calls)."""
        self.feed(text)
        self.finish()
        content = "".join(self.content).strip()
        return content or None, self.calls

    def _emit_content(self, text: str, deltas: list[dict]) -> None:
        if not text:
            return
        self.content.append(text)
        if not text.strip():  # e.g. the newline between two calls
            self._space += text
            return
        text = self._space + text
        # as `parse` strips the whole content, a stream never starts with whitespace (it never ends with any)
        deltas.append({"content": text if self._content_sent else text.lstrip()})
        self._space, self._content_sent = "", True

    def _start_call(self, name: str, deltas: list[dict]) -> None:
        self._space = ""
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": ""}}
        self.calls.append(call)
        deltas.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                                       "function": {"name": name, "arguments": ""}}]})

    def _send_arguments(self, text: str, deltas: list[dict]) -> None:
        if text:
            self.calls[-1]["function"]["arguments"] += text
            self._sent += len(text)
            deltas.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": text}}]})

    def _stream_arguments(self, deltas: list[dict], final: bool) -> None:
        if self._header_end < 0:
            m = _HEADER.match(self._call)
            if m is None:
                return
            self._header_end = m.end()
            self._start_call(json.loads(f'"{m.group(1)}"'), deltas)
        if self._sent == 0:  # the arguments start at their first non-space character
            while self._header_end < len(self._call) and self._call[self._header_end].isspace():
                self._header_end += 1
        args = self._call[self._header_end:]
        # hold back what may be the call object's closing brace and whitespace
        end = len(args) if final else len(args.rstrip(_TRAILING))
        self._send_arguments(args[self._sent:end], deltas)

    def _close_call(self, deltas: list[dict]) -> None:
        self._in_call = False
        try:
            obj = json.loads(self._call)
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
            if self._header_end < 0:  # not a call after all: keep the text
                self._emit_content(CALL_BEGIN + self._call + CALL_END, deltas)
            else:  # started as a call: send what is left as its arguments
                self._stream_arguments(deltas, final=True)
            return
        if self._header_end < 0:  # the whole call arrived at once: send it as the model wrote it
            self._stream_arguments(deltas, final=False)
        if self._header_end < 0:  # e.g. "arguments" before "name"
            self._start_call(obj["name"], deltas)
            self._send_arguments(json.dumps(obj["arguments"], ensure_ascii=False), deltas)
            return
        if self._sent == 0:
            while self._call[self._header_end].isspace():
                self._header_end += 1
        _, end = json.JSONDecoder().raw_decode(self._call, self._header_end)
        rest = self._call[self._header_end:end][self._sent:]
        self._send_arguments(rest, deltas)
