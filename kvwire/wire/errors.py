"""The one exception type the wire layer raises for bad input."""

from __future__ import annotations

__all__ = ["WireError"]


class WireError(ValueError):
    """A payload or frame that is not valid KV-event traffic.

    The message names what was wrong. Decoding either returns a whole batch or
    raises this; it never returns half a batch.
    """
