"""Prompts for GRPO: a JSON Lines file of {"prompt", "answer"}, checked line by line and rendered for generation.

A prompt is a string (one user message) or a list of messages, rendered with the model's chat template and its
generation prompt; a model without a template reads the string as it is. "answer" (optional) is what the reward
compares the reply with.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qkv.chat.data import check_message, json_lines, json_object
from qkv.chat.template import ChatTemplate, Message
from qkv.errors import QkvError
from qkv.tokenizers import Tokenizer

FORMAT = '{"prompt": "…", "answer": "…"}'


@dataclass(frozen=True)
class Prompt:
    """One line of the file: its messages, its reference answer (if any) and its line number."""

    messages: list[Message]
    answer: str | None
    line: int


def parse_prompt(line: str, number: int, source: str) -> Prompt:
    """One JSON Lines line as a prompt, or a one-line error naming the line and the fix."""
    where = f"{source} line {number}"
    obj = json_object(line, where, "prompt", FORMAT)
    if "prompt" not in obj:
        raise QkvError(f'{where} has no "prompt"; write one prompt per line: {FORMAT}')
    value, answer = obj["prompt"], obj.get("answer")
    if isinstance(value, str) and value.strip():
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list) and value:
        messages = [check_message(m, f"{where}, message {i + 1}") for i, m in enumerate(value)]
    else:
        raise QkvError(f'{where}: "prompt" is neither a non-empty string nor a list of messages; write {FORMAT}')
    if answer is not None and not isinstance(answer, (str, int, float)):
        raise QkvError(f'{where}: "answer" is not a string or a number; write {FORMAT}')
    return Prompt(messages, None if answer is None else str(answer), number)


def read_prompts(path: str | Path) -> list[Prompt]:
    """Every prompt of a JSON Lines file (blank lines skipped), checked."""
    found = json_lines(path, parse_prompt, "prompts", FORMAT)
    if len(found) < 2:
        raise QkvError(f"{path} holds {len(found)} prompt(s); give at least 2 (the last tenth is held out): {FORMAT}")
    return found


def render(prompt: Prompt, template: ChatTemplate | None) -> str:
    """The text the model continues: the chat template's rendering with its generation prompt, or the bare prompt."""
    if template is not None:
        return template.render(prompt.messages, add_generation_prompt=True)
    if len(prompt.messages) != 1:
        raise QkvError(f"line {prompt.line} holds a conversation, but the model has no chat template; give "
                       "--chat-template FILE")  # fmt: skip
    return prompt.messages[0]["content"]


def encode_prompts(prompts: list[Prompt], template: ChatTemplate | None, tokenizer: Tokenizer, context: int,
                   max_completion: int, source: str) -> list[list[int]]:  # fmt: skip
    """Each prompt's token ids; a one-line error for a prompt that leaves no room for max_completion tokens."""
    encoded = []
    for p in prompts:
        ids = tokenizer.encode(render(p, template))
        if len(ids) + max_completion > context:
            raise QkvError(f"{source} line {p.line}: the prompt's {len(ids)} tokens and --max-completion-tokens "
                           f"{max_completion} exceed the model's context of {context}; shorten the prompt or lower "
                           "--max-completion-tokens")  # fmt: skip
        encoded.append(ids)
    return encoded
