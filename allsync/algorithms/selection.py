"""Name lookup shared by every registry of ``allsync.algorithms``.

Configs select functions by name (``"grpo"``, ``"token-mean"``, ``"k3"`` ...).
An unknown name raises :class:`UnknownNameError` (a ``ValueError``) that names
the bad value and lists the valid ones, so a typo in a config fails loudly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

T = TypeVar("T")


class UnknownNameError(ValueError):
    """A name that is not in the registry it was looked up in."""

    def __init__(self, kind: str, name: object, valid: list[str]):
        self.kind = kind
        self.name = name
        self.valid = valid
        super().__init__(f"unknown {kind} {name!r}; valid names: {', '.join(valid)}")


def select(table: Mapping[str, T], kind: str, name: str) -> T:
    """Return ``table[name]``; raise :class:`UnknownNameError` naming ``name`` otherwise."""
    try:
        return table[name]
    except (KeyError, TypeError):
        raise UnknownNameError(kind, name, sorted(table)) from None
