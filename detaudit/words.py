"""Wording shared by messages and reports."""

from __future__ import annotations


def joined(items: list) -> str:
    """``1``, ``1 and 2``, ``1, 2 and 3``."""
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def one_based(epoch: int | None) -> int | None:
    """An epoch (or a step within one) as people count them: from 1."""
    return None if epoch is None else epoch + 1


def counted(n: int, noun: str, plural: str = "") -> str:
    """``1 step``, ``2 steps`` (`plural` where adding an s is not the plural)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def op_place(op: dict) -> str:
    """Where an op of the drill-down ran: its module, and outside the model the line of the
    user's code (``(outside the model) at train.py:57``)."""
    site = op.get("site") or ""
    if not site:
        return str(op.get("module") or "(model)")
    path, _, line = site.rpartition(":")
    return f"{op.get('module')} at {path.replace(chr(92), '/').rpartition('/')[2]}:{line}"


def steps_run(lengths: dict[int, int]) -> str:
    """How many steps each repeat ran, by repeat: ``repeat 0 ran 6 steps, repeat 1 ran 3``."""
    return ", ".join(f"repeat {n} ran {steps if i else counted(steps, 'step')}"
                     for i, (n, steps) in enumerate(sorted(lengths.items())))


def rates_text(rates: list[float | None]) -> str:
    """Learning rates, one per parameter group: "0.1, 0.01" ("non-finite" where one is)."""
    return ", ".join("non-finite" if r is None else f"{r:.9g}" for r in rates) or "none"
