"""Raised for a config that cannot run: it names the file and the dotted key."""

from __future__ import annotations


class ConfigError(ValueError):
    pass
