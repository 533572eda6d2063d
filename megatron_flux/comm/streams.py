"""Cross-stream ordering for the fused ops' host path, at the least host cost.

``torch.cuda.Stream.wait_stream`` creates an event per call and ``torch.cuda.stream(...)`` goes
through a context manager that queries the current stream twice; the layers make hundreds of
such hand-offs per training step, where host time bounds the step. :class:`StreamOrder` reuses
one event (a wait takes the event's state when it is queued, so re-recording it afterwards is
safe), and :class:`on_stream` switches streams with ``torch.cuda.set_stream``, restoring the
stream the caller names rather than querying it.
"""

from __future__ import annotations

import torch


class StreamOrder:
    """``order(waiter, producer)``: ``waiter`` runs nothing further until the work queued on
    ``producer`` so far has finished. One reusable event per instance (and device)."""

    def __init__(self) -> None:
        self._event = None

    def __call__(self, waiter: torch.cuda.Stream, producer: torch.cuda.Stream) -> None:
        event = self._event
        if event is None:
            event = self._event = torch.cuda.Event()
        event.record(producer)
        waiter.wait_event(event)


class on_stream:
    """``with on_stream(stream, restore):`` make ``stream`` current, then ``restore`` it (even
    on error). The caller already holds the stream to restore, so unlike ``torch.cuda.stream``
    nothing is queried."""

    __slots__ = ("_stream", "_restore")

    def __init__(self, stream: torch.cuda.Stream, restore: torch.cuda.Stream) -> None:
        self._stream, self._restore = stream, restore

    def __enter__(self) -> None:
        torch.cuda.set_stream(self._stream)

    def __exit__(self, *exc) -> None:
        torch.cuda.set_stream(self._restore)
