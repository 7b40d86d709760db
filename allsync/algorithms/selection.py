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


class Registry(dict):
    """A registry of ``allsync.algorithms`` (name -> entry) that refuses a second entry under a name it holds: an
    extension registered as ``grpo`` would otherwise replace the built-in silently, for every run that imports it.
    ``kind`` names the registry in the refusal."""

    def __init__(self, kind: str, entries: dict):
        super().__init__(entries)
        self.kind = kind

    def __setitem__(self, name: str, entry) -> None:
        if name in self:
            raise ValueError(
                f"{self.kind} {name!r} is registered twice ({origin(self[name])} and {origin(entry)}); "
                "give the new one its own name"
            )
        super().__setitem__(name, entry)


def origin(entry) -> str:
    """The module an entry's function was defined in (an entry dataclass holds it as `compute`)."""
    function = getattr(entry, "compute", entry)
    return getattr(function, "__module__", None) or type(entry).__module__


def select(table: Mapping[str, T], kind: str, name: str) -> T:
    """Return ``table[name]``; raise :class:`UnknownNameError` naming ``name`` otherwise."""
    try:
        return table[name]
    except (KeyError, TypeError):
        raise UnknownNameError(kind, name, sorted(table)) from None
