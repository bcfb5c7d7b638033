"""The root of every error moe-control raises on purpose.

Each layer keeps its own errors in one module (`oracle.errors`, `formats.errors`,
`kernels.errors`, `pool.errors`, ...), each deriving from `MoeControlError`, so a caller can
tell "the product refused this, for a reason it states" from a bug with one `except`, and the
API's error table (`service.api.errors`) maps every one of them to a gRPC status in one place.
This module imports nothing: every layer, the oracle included, may derive from it.
"""

from __future__ import annotations


class MoeControlError(Exception):
    """Base class of every error moe-control raises on purpose (never of a bug)."""
