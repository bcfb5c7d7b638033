"""Fixtures of the worker tests: a fresh segment directory and a hand-moved clock."""

from ipc.fixtures import clock, directory

__all__ = ["clock", "directory"]
