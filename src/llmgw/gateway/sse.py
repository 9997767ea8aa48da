"""The client-facing stream contract, whatever an engine sends (OpenAI's server-sent events).

A streaming client receives only complete events made of `data:` lines and comments (`:` lines), and
exactly one `data: [DONE]`, last:

- events are relayed as soon as they are complete (an event is complete at its blank line); a partial
  event waits for its end, which costs the client nothing, since it cannot use half an event;
- other fields (`event:`, `id:`, `retry:`) and anything that is not a field are dropped; an event left
  with nothing is dropped whole;
- what an engine sends after its `[DONE]` is not relayed, and a second `[DONE]` is never sent;
- when the engine's stream ends mid-event, or breaks off, the partial event is dropped and the stream
  ends with one error event (`data: {"error": {...}}`, which the official openai client raises as an
  `APIError`) and then `[DONE]`, as vLLM ends a stream that failed; a stream that simply forgot its
  `[DONE]` gets one.

The common case, a chunk that is one single-line `data:` event with a JSON object (how engines write
them, one per token), is recognised with one search and three compares and relayed as the engine wrote
it; a chunk of several such events with a few `bytes` counts. That is the contract's cost per event
(bench/ab.py).
"""

from __future__ import annotations

DONE = b"data: [DONE]\n\n"
MAX_EVENT = 8 << 20  # an event still incomplete at this size is not one


class StreamBroken(Exception):
    """The engine's stream cannot be relayed further (an event that never ends)."""


def complete_events(pending: bytes, chunk: bytes) -> tuple[bytes, bytes]:
    """What `pending` (kept from earlier chunks) and `chunk` hold: (the complete events, CRLF made LF and
    ending in their blank line, or b""; what is left of an event not complete yet). Raises `StreamBroken`
    for an incomplete event past `MAX_EVENT`."""
    buf = pending + chunk if pending else chunk
    if b"\r" in buf:
        buf = buf.replace(b"\r\n", b"\n")
    end = buf.rfind(b"\n\n")
    if end < 0:
        if len(buf) > MAX_EVENT:
            raise StreamBroken(f"the engine sent an event longer than {MAX_EVENT} bytes")
        return b"", buf
    return buf[:end + 2], buf[end + 2:]


class SSEFrames:
    """Feed the engine's stream chunk by chunk; relay what `feed` returns; end with `finish` or `broken`."""

    __slots__ = ("pending", "done", "plain")

    def __init__(self) -> None:
        self.pending = b""
        self.done = False  # `[DONE]` has been relayed: nothing more will be
        self.plain = True  # nothing pending and not done: a chunk of whole events may pass as it is

    def feed(self, chunk: bytes) -> bytes:
        """The complete, well-formed events that `chunk` completes (possibly b"")."""
        if self.plain:
            # One single-line `data:` event holding a JSON object, as engines write them: its first newline
            # begins the blank line, and a line ending in `}` is not `[DONE]`. Relayed as it is.
            end = len(chunk) - 2
            if chunk.find(b"\n") == end and chunk[-1] == 10 and chunk[end - 1] == 125 and chunk[:5] == b"data:":
                return chunk
        elif self.done:
            return b""
        out, self.pending = complete_events(self.pending, chunk)
        self.plain = not self.pending
        if not out:
            return b""
        events = out.count(b"\n\n")
        if (out.startswith(b"data:") and out.count(b"\n") == 2 * events and out.count(b"\n\ndata:") == events - 1
                and b"[DONE]" not in out):
            return out  # only single-line data events: as the engine wrote them
        return self._filter(out)

    def _filter(self, out: bytes) -> bytes:
        kept = []
        for event in out.split(b"\n\n"):
            lines = [ln for ln in event.split(b"\n") if ln.startswith((b"data:", b":"))]
            if not lines:
                continue
            if any(ln[5:].strip() == b"[DONE]" for ln in lines if ln.startswith(b"data:")):
                kept.append(DONE)
                self.done = True
                self.plain = False
                self.pending = b""
                break
            kept.append(b"\n".join(lines) + b"\n\n")
        return b"".join(kept)

    def finish(self, error_event: bytes) -> bytes:
        """The end of the stream once the engine's answer ended: `[DONE]` if it was not relayed yet, after
        `error_event` when the engine stopped mid-event (a `data: [DONE]` lacking only its blank line
        counts as said)."""
        if self.done:
            return b""
        tail, self.pending = self.pending.strip(), b""
        self.done = True
        self.plain = False
        if not tail or tail in (b"data: [DONE]", b"data:[DONE]"):
            return DONE
        return error_event + DONE

    def broken(self, error_event: bytes) -> bytes:
        """The end of the stream when the engine broke off: the partial event dropped, then the error and
        `[DONE]` (nothing if `[DONE]` was already relayed)."""
        if self.done:
            return b""
        self.pending = b""
        self.done = True
        self.plain = False
        return error_event + DONE
