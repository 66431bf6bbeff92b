"""The notebook runs top to bottom on the bundled demo model."""

import os

import nbformat
from nbclient import NotebookClient

NOTEBOOK = os.path.join(os.path.dirname(__file__), "..", "notebooks", "speculative_decoding.ipynb")


def test_notebook_runs_top_to_bottom():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), \
        "commit the notebook without outputs"
    NotebookClient(notebook, timeout=600, kernel_name="python3").execute()
    printed = "".join(o.get("text", "") for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs)
    assert "acceptance" in printed and "tokens/s" in printed
    assert any(o.get("data", {}).get("image/png") for cell in notebook.cells for o in cell.get("outputs", []))
