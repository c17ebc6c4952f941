"""Third-party modules a test module names at its top but only its tests use, imported at their first use.

Every pytest worker imports every test module to collect it; openai and datasets take about a second each to import,
and the fast tier runs few of the tests that use them (`python -m pytest -q -m "not slow"`).
"""

from __future__ import annotations

import importlib
from typing import Any


class LazyModule:
    """Stands for the module `name`, imported at the first read of one of its public attributes. Reads of names
    that start with an underscore (pytest's collection asks each module-level object for `_mock_name` and dunders)
    import nothing and find nothing."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        return getattr(importlib.import_module(self._name), attribute)


def lazy_import(name: str) -> Any:
    """The module `name`, imported when a test first uses it (`LazyModule`)."""
    return LazyModule(name)
