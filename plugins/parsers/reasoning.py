"""Reasoning parsers: split a model's reasoning (``<think>...</think>`` and friends) from its answer.

One scanner serves both modes: ``parse`` is ``parse_streaming(text)`` followed by ``flush()``,
so a streamed output split anywhere yields exactly the non-streaming result. A partial tag at
the end of a fragment is held back until it can be decided. A think block that never closes
is all reasoning.

``configure(chat_template_kwargs)`` is called once per request before parsing: a parser whose
``thinking_kwarg`` is false in the request (qwen3 / glm45 with ``enable_thinking: false``, as in
SGLang) does no separation at all: everything is content.
"""

from __future__ import annotations


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``token``."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0


class ThinkTagReasoningParser:
    think_start = "<think>"
    think_end = "</think>"
    force_reasoning = False  # the prompt already opened the block (output starts inside it)
    content_prefix = ""  # dropped right after the end tag (gpt-oss's final-channel header)
    content_suffix = ""  # dropped at the very end (gpt-oss's <|return|>)
    thinking_kwarg: str | None = None  # chat_template_kwargs switch that turns thinking off when false

    def __init__(self) -> None:
        self.buf = ""
        self.state = "reasoning" if self.force_reasoning else "start"  # start | reasoning | after | content
        self.seen_start = False
        self.enabled = True

    def configure(self, chat_template_kwargs: dict) -> None:
        """Per-request options; call before the first parse."""
        if self.thinking_kwarg and chat_template_kwargs.get(self.thinking_kwarg, True) is False:
            self.enabled = False
            self.state = "content"

    def parse(self, text: str) -> tuple[str, str]:
        r1, c1 = self.parse_streaming(text)
        r2, c2 = self.flush()
        return r1 + r2, c1 + c2

    def parse_streaming(self, delta: str) -> tuple[str, str]:
        self.buf += delta
        reasoning = content = ""
        while True:
            if self.state == "start":
                s = self.buf.lstrip()
                if s.startswith(self.think_start):
                    self.buf, self.state = s[len(self.think_start):], "reasoning"
                    continue
                if self.think_start.startswith(s):  # empty or a partial opening tag: wait
                    break
                self.state = "content"
                continue
            if self.state == "reasoning":
                if not self.seen_start and self.buf.lstrip().startswith(self.think_start):  # forced, but the tag came too
                    self.buf = self.buf.lstrip()[len(self.think_start):]
                    self.seen_start = True
                    continue
                if not self.seen_start and self.think_start.startswith(self.buf.lstrip()) and self.buf.strip():
                    break
                if self.buf.strip():
                    self.seen_start = True
                k = self.buf.find(self.think_end)
                if k >= 0:
                    reasoning += self.buf[:k]
                    self.buf, self.state = self.buf[k + len(self.think_end):], "after"
                    continue
                hold = _partial_suffix(self.buf, self.think_end)
                reasoning += self.buf[: len(self.buf) - hold]
                self.buf = self.buf[len(self.buf) - hold:]
                break
            if self.state == "after":  # drop whitespace (and a content header) after the end tag
                s = self.buf.lstrip()
                if self.content_prefix and s.startswith(self.content_prefix):
                    self.buf, self.state = s[len(self.content_prefix):], "content"
                    continue
                if not s or (self.content_prefix and self.content_prefix.startswith(s)):
                    self.buf = s
                    break
                self.buf, self.state = s, "content"
                continue
            # content
            if not self.enabled:
                content, self.buf = self.buf, ""
                break
            hold = _partial_suffix(self.buf, self.content_suffix) if self.content_suffix else 0
            body = self.buf[: len(self.buf) - hold]
            if self.content_suffix and body.endswith(self.content_suffix):
                body = body[: -len(self.content_suffix)]
            content += body.replace(self.content_suffix, "") if self.content_suffix else body
            self.buf = self.buf[len(self.buf) - hold:]
            break
        return reasoning, content

    def flush(self) -> tuple[str, str]:
        """End of output: release whatever was held back."""
        buf, self.buf = self.buf, ""
        if self.state == "reasoning":
            return buf, ""
        if self.state == "after":
            return "", ""
        return "", buf


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """DeepSeek-R1: its template opens <think> in the prompt, so output starts inside reasoning."""

    force_reasoning = True


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """Qwen3 (hybrid): reasoning only when the output opens <think>; none at all with
    ``chat_template_kwargs: {"enable_thinking": false}``."""

    thinking_kwarg = "enable_thinking"


class Qwen3ThinkingReasoningParser(ThinkTagReasoningParser):
    """Qwen3-Thinking-2507: no opening tag in the output; everything before </think> is reasoning."""

    force_reasoning = True


class KimiReasoningParser(ThinkTagReasoningParser):
    think_start = "◁think▷"
    think_end = "◁/think▷"


class GptOssReasoningParser(ThinkTagReasoningParser):
    """gpt-oss harmony: the analysis channel is reasoning, the final channel the answer
    (the channel tokens are special tokens: a request keeps them unless it sets skip_special_tokens)."""

    think_start = "<|channel|>analysis<|message|>"
    think_end = "<|end|>"
    content_prefix = "<|start|>assistant<|channel|>final<|message|>"
    content_suffix = "<|return|>"
    reads_special_tokens = True  # the channel markers are special tokens
