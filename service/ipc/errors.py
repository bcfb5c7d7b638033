"""Errors of the process boundary itself: a malformed protocol line, a segment file that
cannot be made or mapped. Either side raises them, so they live below both."""

from __future__ import annotations

from service.errors import MoeControlError


class ProtocolError(MoeControlError, ValueError):
    """A line that is not a well-formed protocol message."""


class SegmentError(MoeControlError, OSError):
    """A segment cannot be created or opened (no room, a bad name)."""
