"""Text of a token sequence as it grows, piece by piece: what a streamed reply prints or sends."""

from __future__ import annotations

from collections.abc import Callable


class TextStream:
    """Text of a growing token sequence, piece by piece, decoding only the newest tokens (not O(T²))."""

    def __init__(self, decode: Callable[[list[int]], str], context: list[int]) -> None:
        self._decode = decode
        self._tail = context[-4:]  # a few printed tokens: SentencePiece-style decoders need the left context
        self._pending: list[int] = []  # tokens not printed yet

    def push(self, token: int) -> str:
        """Text that `token` completes ('' while a multi-byte character or a rewrite is incomplete)."""
        self._pending.append(token)
        return self._flush(final=False)

    def end(self) -> str:
        """Whatever is left, printed as is."""
        return self._flush(final=True)

    def _flush(self, final: bool) -> str:
        before, after = self._decode(self._tail), self._decode(self._tail + self._pending)
        if after.endswith("\ufffd") and not final:  # wait for the rest of the character
            return ""
        # A decoder that rewrites text it already printed (e.g. cleaning up spaces) cannot be undone on a
        # terminal: print what differs from the common prefix and go on.
        common = next(
            (i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), min(len(before), len(after))
        )
        piece = after[common:]
        self._tail, self._pending = (self._tail + self._pending)[-4:], []
        return piece


__all__ = ["TextStream"]
