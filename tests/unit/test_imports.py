"""``import hf_ropekv`` costs about what ``import torch, transformers`` costs: it must not pull in transformers'
model-loading code (``PreTrainedModel`` lives in ``transformers.modeling_utils``, which imports the fp8 / deepgemm
integrations, ``torch.distributed.tensor`` and more: seconds of start-up for a command-line tool or a worker).

Checked by what a fresh interpreter has imported, not by timing (timings on a shared machine are noise).
"""

from __future__ import annotations

import json
import subprocess
import sys


from conftest import SUBPROCESS_CWD


#: Modules that only loading or building a model needs; each costs a second or more to import.
MODEL_LOADING_MODULES = (
    "transformers.modeling_utils",
    "transformers.conversion_mapping",
    "transformers.integrations.finegrained_fp8",
)


def _imported_after(statement: str, names: tuple[str, ...]) -> dict[str, bool]:
    """Which of ``names`` a fresh interpreter has in ``sys.modules`` after ``statement``."""
    code = f"import json, sys\n{statement}\nprint(json.dumps({{n: n in sys.modules for n in {list(names)!r}}}))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=SUBPROCESS_CWD, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_probe_sees_model_loading_code_when_it_is_imported() -> None:
    """The check below can fail: importing PreTrainedModel shows every one of these modules as loaded."""
    assert all(_imported_after("from transformers import PreTrainedModel", MODEL_LOADING_MODULES).values())


def test_import_hf_ropekv_does_not_load_model_loading_code() -> None:
    imported = _imported_after("import hf_ropekv", MODEL_LOADING_MODULES + ("hf_ropekv",))
    assert imported.pop("hf_ropekv")
    assert [name for name, loaded in imported.items() if loaded] == []


def test_import_hf_ropekv_does_not_load_the_compiler() -> None:
    imported = _imported_after("import hf_ropekv", ("torch._dynamo", "sympy", "torch.distributed.tensor"))
    assert [name for name, loaded in imported.items() if loaded] == []

