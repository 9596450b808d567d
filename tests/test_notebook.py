"""examples/quickstart.ipynb executes top to bottom (tiny mode: a random 2-layer model, seconds on a CPU).

The notebook's own assertions check that the budgeted cache evicted and held less than the DynamicCache.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "quickstart.ipynb"

pytestmark = pytest.mark.notebook


def test_quickstart_notebook_executes(tmp_path, monkeypatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")

    monkeypatch.setenv("HF_ROPEKV_NOTEBOOK_TINY", "1")
    # The kernel is the same interpreter, started with this environment: it imports the same hf_ropekv.
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()

    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    assert not [out for out in outputs if out.get("output_type") == "error"]
    text = "".join(out.get("text", "") for out in outputs if out.get("output_type") == "stream")
    assert "TINY=True" in text
    assert "RopeKVCache: saw" in text
    assert any("image/png" in out.get("data", {}) for out in outputs), "the memory plot was drawn"
