"""Batched generation: many sequences decoded together, admitted and retired between steps (continuous batching)."""

from qkv.engine.engine import Busy, Closed, Engine, Handle
from qkv.engine.requests import Event, Finished, FinishReason, Request, StopText, Token
from qkv.engine.samples import continuations

__all__ = ["Busy", "Closed", "Engine", "Event", "FinishReason", "Finished", "Handle", "Request",
           "StopText", "Token", "continuations"]
