"""Chat templates: the Jinja template a checkpoint ships (GGUF's tokenizer.chat_template, tokenizer_config.json's
chat_template, chat_template.jinja), rendered as transformers' apply_chat_template renders it.

A template turns a list of {"role", "content"} messages into one string with the model's own markers around each
turn (SmolLM2's ChatML: <|im_start|>user\\n…<|im_end|>\\n, and a default system message when none is given).
The model was trained on exactly that string, so fine-tuning and chatting must reproduce it to the character.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from qkv.errors import QkvError
from qkv.io.files import atomic_write_bytes, load_json
from qkv.tokenizers import Tokenizer

TEMPLATE_FILE = "chat_template.jinja"  # beside a run's tokenizer, as transformers writes it
ROLES = ("system", "user", "assistant")
GIVE_TEMPLATE = "give one with --chat-template FILE (a Jinja chat template, e.g. a model's chat_template.jinja)"
Message = dict[str, str]


class ChatTemplate:
    """A compiled chat template and the special tokens it may refer to (bos_token, eos_token)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", origin: str | None = None) -> None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise QkvError(f"the chat template refuses the conversation: {message}")

        # transformers' settings: a sandbox (a template is data, never code), trim_blocks and lstrip_blocks.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])  # fmt: skip
        env.globals.update(raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))  # fmt: skip
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as e:
            if origin is not None and origin.startswith("--chat-template"):
                raise QkvError(f"{origin} is not a valid Jinja template ({e}); fix that file") from None
            where = f"the chat template of {origin}" if origin else "the chat template"
            raise QkvError(f"{where} is not valid Jinja ({e}); {GIVE_TEMPLATE}") from None
        self.source = source
        self.tokens = {"bos_token": bos_token, "eos_token": eos_token}

    @classmethod
    def of(cls, source: str, tokenizer: Tokenizer, origin: str | None = None) -> ChatTemplate:
        """The template with the tokenizer's end-of-text token as eos_token (a template may write it); origin: where
        it came from ("--chat-template FILE", or the model's path), for messages."""
        eos = tokenizer.decode([tokenizer.eos_id]) if tokenizer.eos_id is not None else ""
        return cls(source, eos_token=eos, origin=origin)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The conversation as the model reads it; add_generation_prompt: end with the assistant's turn opening."""
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     tools=None, documents=None, **self.tokens)  # fmt: skip

    def save(self, directory: Path) -> None:
        """Write the template as chat_template.jinja into `directory`."""
        atomic_write_bytes(Path(directory) / TEMPLATE_FILE, self.source.encode("utf-8"))


def template_source(path: str | Path | None = None, metadata: dict[str, Any] | None = None) -> str | None:
    """A checkpoint's chat template: a directory's chat_template.jinja, tokenizer_config.json's chat_template, a
    run's base checkpoint's (config.json), or the metadata a GGUF file gave; None when it has none."""
    if metadata and isinstance(metadata.get("chat_template"), str):
        return str(metadata["chat_template"])
    directory = Path(path) if path is not None else None
    if directory is None or not directory.is_dir():
        return None
    if (directory / TEMPLATE_FILE).is_file():
        return (directory / TEMPLATE_FILE).read_text(encoding="utf-8")
    tokenizer_config = directory / "tokenizer_config.json"
    if tokenizer_config.is_file() and isinstance(load_json(tokenizer_config).get("chat_template"), str):
        return str(load_json(tokenizer_config)["chat_template"])
    if (directory / "config.json").is_file():  # a qkv run of a checkpoint: the template that checkpoint had
        base = load_json(directory / "config.json").get("base") or {}
        return template_source(None, base.get("metadata") or {})
    return None


def read_template_file(path: str | Path) -> str:
    """The text of a --chat-template file, or a one-line error."""
    path = Path(path)
    if not path.is_file():
        raise QkvError(f"--chat-template {path}: no such file; {GIVE_TEMPLATE}")
    return path.read_text(encoding="utf-8")
