"""Whether this run is the fast tier (`python -m pytest -m "not slow"`), and how many examples a property test draws
in it. conftest's `pytest_configure` sets `FAST` in each process before any test module is collected."""

FAST = False


def examples(full: int) -> int:
    """A property test's `max_examples`: `full` in the full suite; a third of it, at least 10, in the fast tier (a
    developer's check after a change, where the full suite and CI draw the rest; a failing example is saved in
    hypothesis' database and drawn first by every later run)."""
    return max(10, full // 3) if FAST else full
