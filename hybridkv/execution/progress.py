"""Progress a person watches: a tqdm bar when asked (`use_tqdm`), nothing otherwise."""

from __future__ import annotations

from typing import Any


class NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool, desc: str = "hybridkv", unit: str = "req") -> Any:
    """A tqdm bar of `total` units, or a `NoProgress` when not `enabled`."""
    if not enabled:
        return NoProgress()
    from tqdm.auto import tqdm  # only when asked: in Jupyter without ipywidgets tqdm.auto warns on import

    return tqdm(total=total, desc=desc, unit=unit)
