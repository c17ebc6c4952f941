"""Every notebook runs top to bottom, and the committed notebooks carry no outputs that could go stale."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT_SECONDS = 120


def test_the_seven_notebooks_are_there():
    assert [path.name for path in NOTEBOOKS] == [
        "01_quickstart.ipynb",
        "02_memory_anatomy.ipynb",
        "03_prefix_caching.ipynb",
        "04_when_a_model_is_refused.ipynb",
        "05_beam_search_and_forks.ipynb",
        "06_models_that_change.ipynb",
        "07_a_cache_that_outlives_the_kernel.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_committed_notebook_has_no_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code_cells
    assert all(cell.outputs == [] and cell.execution_count is None for cell in code_cells)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs_top_to_bottom(path):
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_SECONDS,
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    client.execute()  # raises CellExecutionError naming the cell if any cell fails
    errors = [out for cell in notebook.cells for out in cell.get("outputs", []) if out.output_type == "error"]
    assert errors == []
