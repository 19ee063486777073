"""The ``json_array`` tool parser: output that IS a JSON array of calls, ``[{"name": ...,
"parameters": {...}}, ...]`` with no marker token.

This is the format SGLang constrains the output to for ``tool_choice: "required"`` when the
model's own call format is not used; core's chat endpoint resolves this parser by name to read
such output back (whole or streamed incrementally). It reuses the Mistral parser's array scanner:
the array must open the output (after whitespace), there is no ``[TOOL_CALLS]`` prefix.
"""

from __future__ import annotations

from core_plugins.parsers.tools import MistralToolParser


class JsonArrayToolParser(MistralToolParser):
    def find_start(self, text: str, i: int) -> tuple[int, int]:
        s = len(text) - len(text.lstrip())
        return (s, s) if i == 0 and text[s:s + 1] == "[" else (-1, -1)

    def hold_back(self, text: str, i: int) -> int:
        # while only whitespace has arrived, it may still precede the array
        return len(text) - i if i == 0 and not text.strip() else 0

    def structural_tag(self, tools, name=None, parallel=True):
        return None  # the format is the JSON schema itself: constrain with SGLang's schema, not a tag
