"""Checks of user-given settings (`SamplingParams`, `EngineConfig`, `SchedulerConfig`). Each names the
setting, the rule and the value it got: a TypeError for a wrong type, a ValueError for a value out of
range. A bool is never a count here (`max_tokens=True` is a mistake, not 1)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence


def is_int(value: object) -> bool:
    """An int or a numpy int, and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value: object, minimum: int | None = None, rule: str = "") -> int:
    """`value` as an int (numpy ints too), at least `minimum`; `rule` says more in the error."""
    if not is_int(value):
        fix = f"; pass {name}={int(value)}" if isinstance(value, float) and value.is_integer() else ""
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}){fix}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}{rule}, got {value}")
    return int(value)


def check_float(name: str, value: object) -> float:
    """`value` as a finite float (ints and numpy floats too)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return float(value)


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def check_choice(name: str, value: object, choices: Sequence[object]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
