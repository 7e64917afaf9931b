"""Prompt token ids for a request, built so that a continuing conversation extends its parent's exact
tokens.

First turn: the chat template renders the messages (with the generation prompt) and the text is
tokenized once. A continuation of cached interaction P: the template renders P's conversation (its
messages plus its reply) and the new one; when the new rendering starts with P's, the prompt is

    P.prompt_ids + P.output_ids + tokens(glue + the rendered text after P's conversation)

where `glue` is whatever the template writes after the reply's text that the model did not itself
generate (e.g. the newline after Qwen's `<|im_end|>`; nothing for the tiny model's template). So the
tokens the model produced are kept as produced (a stop token included) and only new messages are
tokenized. A template that rewrites history (the new rendering does not start with P's) falls back to
tokenizing the whole rendering; that interaction is then not `incremental` and `concat` refuses it.
"""

from __future__ import annotations

from typing import Any

from services.rollout.agent.cache import Interaction
from services.rollout.agent.requests import Message
from services.rollout.agent.toolcalls import format_tool_call


def glue_after(rendered_tail: str, generated_text: str) -> str:
    """The part of `rendered_tail` (what the template writes after the reply's content) that the
    generated text does not already end with: the longest prefix of the tail that the generated text
    ends with is dropped."""
    for k in range(len(rendered_tail), -1, -1):
        if generated_text.endswith(rendered_tail[:k]):
            return rendered_tail[k:]
    return rendered_tail


class ChatTokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_id: int | None = eos if isinstance(eos, int) else None

    def render(self, messages: list[Message], tools: list[dict[str, Any]] | None, generation_prompt: bool) -> str:
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(
            [_for_template(m) for m in messages], tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False).input_ids) if text else []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def prompt_ids(self, messages: list[Message], tools: list[dict[str, Any]] | None, parent: Interaction | None) -> tuple[list[int], bool]:
        """(prompt ids, whether they extend `parent`'s exact tokens)."""
        full = self.render(messages, tools, generation_prompt=True)
        if parent is not None:
            before = self.render(parent.conversation, tools, generation_prompt=False)
            if full.startswith(before):
                tail = _tail_after_reply(before, parent.reply)
                glue = glue_after(tail, self.decode(parent.output_ids, skip_special_tokens=False))
                return parent.full_ids + self.encode(glue + full[len(before):]), True
        return self.encode(full), False


def _tail_after_reply(rendered: str, reply: Message) -> str:
    """What the template wrote after the reply's own text (its end-of-turn markup)."""
    text = reply.get("content") or ""
    for call in reply.get("tool_calls") or ():
        text = format_tool_call(call["function"]["name"], call["function"]["arguments"])  # the last thing written
    pos = rendered.rfind(text) if text else -1
    return rendered[pos + len(text):] if pos >= 0 else ""


def _for_template(message: Message) -> dict[str, Any]:
    """Templates read `content` always; tool calls keep OpenAI's shape, which HF templates expect."""
    out: dict[str, Any] = {"role": message["role"], "content": message.get("content") or ""}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    return out
