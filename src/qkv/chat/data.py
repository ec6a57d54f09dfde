"""Conversations for fine-tuning: a JSON Lines file of {"messages": [{"role", "content"}, …]}, rendered with the
model's chat template, tokenized whole, and a loss mask that trains only what the assistant says.

The file is read directly, not through `qkv prepare`: a supervised fine-tuning set is thousands of conversations,
not billions of tokens, and each conversation is one example (padded, never cut into windows across conversations),
so it is tokenized in memory when the run starts. A conversation longer than the context is dropped, not cut: a
truncated one would teach replies that stop mid-sentence without their end-of-turn token.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from qkv.chat.template import ROLES, ChatTemplate, Message
from qkv.errors import QkvError
from qkv.tokenizers import Tokenizer

CHAT_SUFFIXES = (".jsonl", ".ndjson")
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")  # ChatML, Llama 3, Phi-3, Gemma
T = TypeVar("T")
FORMAT = '{"messages": [{"role": "user", "content": "…"}, {"role": "assistant", "content": "…"}]}'


@dataclass(frozen=True)
class Conversation:
    """One line of the file: its messages, and its line number for messages."""

    messages: list[Message]
    line: int


def is_chat_file(path: str | Path | None) -> bool:
    """Whether `path` is a JSON Lines file of conversations (its first object has "messages"); conversations in
    another shape (a JSON array, JSON Lines named .txt) are refused in one line that says what to write."""
    if path is None or not Path(path).is_file():
        return False
    first = _first_line(Path(path))
    if not str(path).endswith(CHAT_SUFFIXES):
        if _is_conversation(_json(first)) or _array_of_conversations(Path(path), first):
            raise QkvError(f"{path} holds conversations; write them as JSON Lines in a file named .jsonl, one "
                           f"conversation a line: {FORMAT}")  # fmt: skip
        return False
    if first is None:
        return True  # empty: read_conversations says so
    if _array_of_conversations(Path(path), first):
        raise QkvError(f"{path} is a JSON array; write JSON Lines, one conversation a line: {FORMAT}")
    return _is_conversation(_json(first))


def _first_line(path: Path) -> str | None:
    """The file's first non-blank line (None: none)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        return next((line for line in f if line.strip()), None)


def _json(line: str | None) -> Any:
    """The line's JSON value (None where it is none)."""
    try:
        return json.loads(line) if line is not None else None
    except json.JSONDecodeError:
        return None


def _is_conversation(value: Any) -> bool:
    """Whether a JSON value is one conversation: an object with "messages"."""
    return isinstance(value, dict) and "messages" in value


def _array_of_conversations(path: Path, first: str | None) -> bool:
    """Whether the file is one JSON array whose first element is a conversation."""
    if first is None or not first.lstrip().startswith("["):
        return False
    whole = _json(path.read_text(encoding="utf-8", errors="replace"))
    return isinstance(whole, list) and bool(whole) and _is_conversation(whole[0])


def check_message(message: Any, where: str) -> Message:
    """A {"role", "content"} message, or a one-line error naming where it is and what to write."""
    if not isinstance(message, dict):
        raise QkvError(f"{where} is not an object; write each message as {{\"role\": …, \"content\": …}}")
    for key in ("role", "content"):
        if not isinstance(message.get(key), str):
            raise QkvError(f"{where} has no \"{key}\" string; give each message a \"role\" and a \"content\"")
    if message["role"] not in ROLES:
        raise QkvError(f"{where} has role {message['role']!r}; use one of: {', '.join(ROLES)}")
    return {"role": message["role"], "content": message["content"]}


def json_object(line: str, where: str, what: str, form: str) -> dict[str, Any]:
    """One JSON Lines line's object, or a one-line error naming `where` it is and the form to write (`what`: one
    conversation, pair, prompt)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise QkvError(f"{where} is not JSON ({e.msg}); write one {what} per line: {form}") from None
    if not isinstance(obj, dict):
        raise QkvError(f"{where} is not an object; write one {what} per line: {form}")
    return obj


def parse_conversation(line: str, number: int, source: str) -> Conversation:
    """One JSON Lines line as a conversation with at least one assistant message."""
    where = f"{source} line {number}"
    obj = json_object(line, where, "conversation", FORMAT)
    if not isinstance(obj.get("messages"), list):
        raise QkvError(f"{where} has no \"messages\" list; write one conversation per line: {FORMAT}")
    messages = [check_message(m, f"{where}, message {i + 1}") for i, m in enumerate(obj["messages"])]
    if not any(m["role"] == "assistant" for m in messages):
        raise QkvError(f"{where} has no assistant message, so nothing to learn from; add the reply or drop the line")
    return Conversation(messages, number)


def json_lines(path: str | Path, parse: Callable[[str, int, str], T], what: str, form: str) -> list[T]:
    """Every non-blank line of a JSON Lines file, parsed by parse(line, number, source); a one-line error for a file
    that does not exist (`what` it should hold, and its `form`)."""
    if not Path(path).is_file():
        raise QkvError(f"--data {path} does not exist; give a JSON Lines file of {what}: {form}")
    with open(path, encoding="utf-8") as f:
        return [parse(line, n, str(path)) for n, line in enumerate(f, 1) if line.strip()]


def read_conversations(path: str | Path) -> list[Conversation]:
    """Every conversation of a JSON Lines file (blank lines skipped), checked."""
    found = json_lines(path, parse_conversation, "conversations", FORMAT)
    if not found:
        raise QkvError(f"{path} holds no conversations; write one per line: {FORMAT}")
    return found


def end_of_turn(tokenizer: Tokenizer) -> str | None:
    """The text of the token that ends a turn: a known end-of-turn marker in the vocabulary, else end-of-text."""
    for marker in END_OF_TURN:
        try:
            if len(tokenizer.encode(marker)) == 1:
                return marker
        except QkvError:  # a character vocabulary cannot spell it: not this model's marker
            continue
    return tokenizer.decode([tokenizer.eos_id]) if tokenizer.eos_id is not None else None


def _first_token(ids: Sequence[int], tokenizer: Tokenizer, prefix: str, inclusive: bool) -> int:
    """The index of the token in `ids` where the text `prefix` ends (inclusive: the token that holds its last
    character, when a token straddles the boundary)."""
    from qkv.generation import common_prefix  # here: reading conversations needs no torch

    head = tokenizer.encode(prefix)
    n = common_prefix(ids, head)
    return n if n == len(head) or not inclusive else n + 1


def assistant_spans(template: ChatTemplate, messages: Sequence[Message], text: str,
                    eot: str | None) -> list[tuple[int, int]]:  # fmt: skip
    """Character spans of `text` (the rendered conversation) that the assistant says: each assistant message's
    content and the end-of-turn marker right after it."""
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        content = message["content"]
        start = -1
        if message["role"] == "assistant":  # where the template opens this turn: exact when it renders prefixes alike
            opening = template.render(messages[:i], add_generation_prompt=True)
            if text.startswith(opening) and text.startswith(content, len(opening)):
                start = len(opening)
        start = text.find(content, cursor) if start < 0 else start
        if start < 0:
            raise QkvError(f"the chat template does not write message {i + 1}'s content as it is; qkv finds each "
                           "assistant reply in the rendered text to train on it")  # fmt: skip
        cursor = end = start + len(content)
        if message["role"] == "assistant":
            if eot is not None and text.startswith(eot, end):
                end += len(eot)
            spans.append((start, end))
    return spans


def encode_chat(template: ChatTemplate, tokenizer: Tokenizer, messages: Sequence[Message],
                eot: str | None = None) -> tuple[list[int], list[bool]]:  # fmt: skip
    """The rendered conversation's token ids, and for each token whether the loss trains on it (assistant content
    and its end-of-turn token `eot`, found if not given; a token that straddles a span's edge is trained)."""
    text = template.render(messages)
    ids = tokenizer.encode(text)
    mask = [False] * len(ids)
    eot = end_of_turn(tokenizer) if eot is None else eot
    for start, end in assistant_spans(template, messages, text, eot):
        first = _first_token(ids, tokenizer, text[:start], inclusive=False)
        last = _first_token(ids, tokenizer, text[:end], inclusive=True)
        for j in range(first, min(last, len(ids))):
            mask[j] = True
    return ids, mask


def encode_reply(template: ChatTemplate, tokenizer: Tokenizer, prompt: Sequence[Message], reply: Sequence[Message],
                 eot: str | None = None) -> tuple[list[int], list[bool]]:  # fmt: skip
    """The rendered prompt-and-reply's token ids, and for each token whether it belongs to the reply's assistant
    turns (as encode_chat masks them); the prompt's own assistant turns are context, never trained."""
    ids, mask = encode_chat(template, tokenizer, [*prompt, *reply], eot)
    opening = _first_token(ids, tokenizer, template.render(prompt, add_generation_prompt=True), inclusive=False)
    return ids, [m and j >= opening for j, m in enumerate(mask)]
