"""Chat: conversations rendered with a model's own template, trained on the assistant's turns, and talked to.

    template.py   the checkpoint's Jinja chat template, rendered as transformers renders it
    data.py       a JSON Lines file of {"messages": […]}: checked, rendered, tokenized, and the assistant's mask
    examples.py   tokenized conversations as padded training batches, split and filtered by length
    session.py    a conversation with a model: history, system message, context rule, streamed replies
    sampling.py   how chat samples: the flags, the checkpoint's recommendation, or qkv's measured default
"""

from qkv.chat.data import encode_chat, end_of_turn, is_chat_file, read_conversations
from qkv.chat.examples import ChatExamples, encode_splits
from qkv.chat.sampling import CHAT_SAMPLING, chat_sampling
from qkv.chat.session import ChatSession, stop_ids
from qkv.chat.template import ChatTemplate, template_source

__all__ = [
    "CHAT_SAMPLING",
    "ChatExamples",
    "ChatSession",
    "ChatTemplate",
    "chat_sampling",
    "encode_chat",
    "encode_splits",
    "end_of_turn",
    "is_chat_file",
    "read_conversations",
    "stop_ids",
    "template_source",
]
