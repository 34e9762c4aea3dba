"""Wording shared by messages and reports."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str = "") -> str:
    """``1 step``, ``2 steps`` (`plural` where adding an s is not the plural)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
