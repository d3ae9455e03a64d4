"""Reasoning split from the answer in a thinking model's text (`--reasoning-parser`).

Qwen3 and DeepSeek-R1 write their thinking between `<think>` and `</think>`, and the
answer (content, tool calls) after it; their chat templates often put the `<think>` in the
prompt, so the output opens inside the reasoning and only `</think>` shows. As vLLM's
parsers of the same names read it:

    qwen3        reasoning up to `</think>`, then content; with `enable_thinking: false`
                 (chat_template_kwargs) the whole text is content
    deepseek_r1  the same, whatever the template variables

An opening `<think>` in the output is dropped. A text without `</think>` was cut short
while thinking: all of it is reasoning. Two cases start in the content instead:

- the prompt already closed the reasoning (it ends with `</think>`: a template that
  turns thinking off writes an empty `<think></think>` block);
- a grammar constrains the output (structured outputs, a required or named tool call):
  rlserve applies it from the first token, so the output is reasoning only when it
  opens with `<think>`. (vLLM applies the grammar after the reasoning instead.)

A stream is split as it grows, a tag cut between two pieces held back until it is whole;
splitting a whole text is splitting it as one stream, so both agree.
"""

from __future__ import annotations

from typing import Any, NamedTuple

START, END = "<think>", "</think>"


class ReasoningPiece(NamedTuple):
    reasoning: str
    content: str


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkStream:
    """One sample's text, fed as it grows: what is new of its reasoning and its content.

    states: "open" (undecided: reasoning only if the text opens with <think>),
    "reasoning" (before </think>), "content" (after it)."""

    def __init__(self, state: str):
        self._state = state
        self._seen_start = False
        self._buf = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state != "content"

    def feed(self, text: str) -> ReasoningPiece:
        self._buf += text
        reasoning, content = "", ""
        if self._state == "open":
            stripped = self._buf.lstrip()
            if START.startswith(stripped):  # whitespace, or a piece of the tag: wait
                return ReasoningPiece("", "")
            self._state = "reasoning" if stripped.startswith(START) else "content"
        if self._state == "reasoning":
            if not self._seen_start:
                i, j = self._buf.find(START), self._buf.find(END)
                if i >= 0 and (j < 0 or i < j):
                    self._buf = self._buf[:i] + self._buf[i + len(START):]
                    self._seen_start = True
            j = self._buf.find(END)
            if j < 0:
                keep = max(_partial_suffix(self._buf, END),
                           0 if self._seen_start else _partial_suffix(self._buf, START))
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return ReasoningPiece(reasoning, "")
            reasoning, self._buf = self._buf[:j], self._buf[j + len(END):]
            self._state = "content"
        content, self._buf = self._buf, ""
        return ReasoningPiece(reasoning, content)

    def finish(self) -> ReasoningPiece:
        """The end of the text: what was held back (an unfinished tag is text as written)."""
        rest, self._buf = self._buf, ""
        if self._state == "reasoning":
            return ReasoningPiece(rest, "")
        return ReasoningPiece("", rest)


def split_whole(stream: ThinkStream, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole text, None for an empty one."""
    first, last = stream.feed(text), stream.finish()
    reasoning, content = first.reasoning + last.reasoning, first.content + last.content
    return reasoning or None, content or None


class ReasoningParser:
    """A `--reasoning-parser`: how a request's output starts, given its prompt."""

    def __init__(self, name: str, honours_enable_thinking: bool):
        self.name = name
        self.honours_enable_thinking = honours_enable_thinking

    def stream(self, prompt_text: str, template_kwargs: dict[str, Any] | None,
               constrained: bool) -> ThinkStream:
        """A splitter for one sample of a request: `prompt_text` as rendered,
        `template_kwargs` its chat_template_kwargs, `constrained` whether a grammar
        shapes the output."""
        if prompt_text.rstrip().endswith(END):
            return ThinkStream("content")
        if self.honours_enable_thinking and (template_kwargs or {}).get("enable_thinking") is False:
            return ThinkStream("content")
        return ThinkStream("open" if constrained else "reasoning")

    def split(self, prompt_text: str, template_kwargs: dict[str, Any] | None, constrained: bool,
              text: str) -> tuple[str | None, str | None]:
        return split_whole(self.stream(prompt_text, template_kwargs, constrained), text)


REASONING_PARSERS = {"qwen3": ReasoningParser("qwen3", honours_enable_thinking=True),
                     "deepseek_r1": ReasoningParser("deepseek_r1", honours_enable_thinking=False)}
