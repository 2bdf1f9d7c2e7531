"""Stop strings (clover-spec 5.2: "stop at end tokens, stop strings or the token budget").

Semantics (those of the OpenAI API and llama-cpp-python's ``stop``, made independent of how
the text is chunked):

- Stop strings are matched on committed (final) text only, across decoder steps: a stop
  string may span two diffusion blocks, two AR tokens or two streamed pieces.
- Generation ends at the first character where some stop string is complete; the output is
  the text before that occurrence (the stop string itself is not written). When several stop
  strings complete at the same character, the longest (the one starting earliest) wins.
  Because matches are decided per character, the result does not depend on how the text
  arrives (per token, per block, all at once).
- Streaming never writes text that could still turn out to be part of a stop string: the
  longest suffix of the pending text that is a proper prefix of some stop string is held back
  and released once it cannot match any more (or when generation ends without a match).
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["MAX_STOP_STRINGS", "check_stop", "StopFilter"]

#: At most this many stop strings per call (OpenAI allows 4; llama-cpp-python has no limit).
MAX_STOP_STRINGS = 16


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``: the text a
    stream holds back because it may still become ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def check_stop(stop) -> list[str]:
    """Validate ``stop``: None, a non-empty str, or a list/tuple of at most
    :data:`MAX_STOP_STRINGS` non-empty str. Returns the list of stop strings (duplicates
    removed, order kept; [] for None or an empty list). Raises ValueError naming ``stop``."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, (list, tuple)):
        raise ValueError(f"stop: expected a str or a list of str, got {type(stop).__name__}")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop: {len(stop)} strings, at most {MAX_STOP_STRINGS} are allowed")
    out: list[str] = []
    for k, s in enumerate(stop):
        if not isinstance(s, str):
            raise ValueError(f"stop[{k}]: expected a str, got {type(s).__name__}")
        if not s:
            raise ValueError(f"stop[{k}]: empty string (a stop string needs at least one character)")
        if s not in out:
            out.append(s)
    return out


class StopFilter:
    """Incremental stop-string matcher over a stream of text pieces.

    ``push(text)`` adds text and returns True once a stop string is complete (then
    :attr:`matched` is that string and the pending text ends right before it; later pushes
    are ignored). ``take()`` returns the text that is safe to write now (all of it after a
    match); ``flush()`` returns everything still pending (end of generation).
    ``"".join(take() pieces) + flush()`` is the whole text cut before the first stop string.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.matched: str | None = None
        self._buf = ""

    def push(self, text: str) -> bool:
        if self.matched is not None:
            return True
        if not text:
            return False
        old = len(self._buf)
        buf = self._buf + text
        best_end = best_len = None
        best = None
        for s in self.stops:
            # Any occurrence inside the old pending text would have matched earlier, so
            # only occurrences ending in the new text are searched.
            i = buf.find(s, max(0, old - len(s) + 1))
            if i < 0:
                continue
            end = i + len(s)
            if best is None or end < best_end or (end == best_end and len(s) > best_len):
                best, best_end, best_len = s, end, len(s)
        if best is None:
            self._buf = buf
            return False
        self.matched = best
        self._buf = buf[: best_end - best_len]
        return True

    def _held(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of a stop."""
        return max((partial_suffix(self._buf, s) for s in self.stops), default=0)

    def take(self) -> str:
        if self.matched is not None:
            return self.flush()
        n = len(self._buf) - self._held()
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def flush(self) -> str:
        out, self._buf = self._buf, ""
        return out
