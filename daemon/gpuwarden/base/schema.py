"""Typed reads from a located YAML document, collecting one-line errors.

Shared by the config and the simulator's scenario files so both reject bad
input the same way: unknown keys, wrong types and out-of-range values.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Iterable

from .yamlfile import ConfigError, ConfigErrors, Document, Path_

MISSING = object()
NONE_WORDS = ("none", "null")  # how a user says "leave this alone"


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


class Reader:
    def __init__(self, doc: Document):
        self.doc = doc
        self.errors: list[ConfigError] = []

    # -- plumbing -------------------------------------------------------------
    def fail(self, path: Path_, message: str, allowed: str | None = None) -> None:
        self.errors.append(self.doc.error(path, message, allowed))

    def raise_if_errors(self) -> None:
        if self.errors:
            files = list(dict.fromkeys(e.file for e in self.errors))
            raise ConfigErrors(sorted(self.errors, key=lambda e: (files.index(e.file), e.line)))

    def get(self, path: Path_) -> Any:
        value = self.doc.value
        for part in path:
            if isinstance(value, dict) and part in value:
                value = value[part]
            elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
                value = value[int(part)]
            else:
                return MISSING
        return value

    # -- shapes ---------------------------------------------------------------
    def mapping(self, path: Path_, keys: Iterable[str] | None, required: Iterable[str] = ()) -> dict:
        """The mapping at path ({} when absent); unknown and missing keys are errors."""
        value = self.get(path)
        if value is MISSING or value is None:
            value = {}
        if not isinstance(value, dict):
            self.fail(path, f"expected a mapping, got {type_name(value)}")
            return {}
        if keys is not None:
            allowed = sorted(keys)
            for key in value:
                if key not in allowed:
                    self.fail(path + (key,), "unknown key", "allowed: " + ", ".join(allowed))
        for key in required:
            if key not in value:
                self.fail(path, f"missing required key '{key}'")
        return value

    def sequence(self, path: Path_) -> list:
        value = self.get(path)
        if value is MISSING or value is None:
            return []
        if not isinstance(value, list):
            self.fail(path, f"expected a list, got {type_name(value)}")
            return []
        return value

    # -- scalars --------------------------------------------------------------
    def boolean(self, path: Path_, default: bool) -> bool:
        value = self.get(path)
        if value is MISSING:
            return default
        if not isinstance(value, bool):
            self.fail(path, f"expected true or false, got {type_name(value)} {value!r}")
            return default
        return value

    def number(self, path: Path_, default: Any, low: float, high: float,
               integer: bool = False, unit: str = "") -> Any:
        value = self.get(path)
        if value is MISSING:
            return default
        wanted = "an integer" if integer else "a number"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
            self.fail(path, f"expected {wanted}, got {type_name(value)} {value!r}",
                      f"{low:g}-{high:g}{unit}")
            return default
        if not low <= value <= high:
            self.fail(path, f"{value:g}{unit} is out of range", f"{low:g}-{high:g}{unit}")
            return default
        return value

    def string(self, path: Path_, default: Any, choices: Iterable[str] | None = None) -> Any:
        value = self.get(path)
        if value is MISSING:
            return default
        if not isinstance(value, str) or not value:
            self.fail(path, f"expected a non-empty string, got {type_name(value)} {value!r}")
            return default
        if choices is not None and value not in choices:
            self.fail(path, f"'{value}' is not a valid choice", "allowed: " + ", ".join(choices))
            return default
        return value

    def optional_number(self, path: Path_, default: Any, low: float, high: float, unit: str = "") -> Any:
        """A number, or none/null to switch the setting off."""
        value = self.get(path)
        if value is None or (isinstance(value, str) and value.lower() in NONE_WORDS):
            return None
        if isinstance(value, str):
            self.fail(path, f"expected a number or none, got '{value}'", f"{low:g}-{high:g}{unit} or none")
            return default
        return self.number(path, default, low, high, unit=unit)
