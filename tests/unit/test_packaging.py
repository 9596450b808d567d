"""What an install of this repository contains, read from setup.cfg as setuptools itself reads it.

setup.cfg lists the packages by hand (the Triton kernels live in the top-level ``kernels/`` folder but install
only as ``hf_ropekv.kernels``: a top-level ``kernels`` module would shadow HF's PyPI package of that name,
which transformers probes for). A list by hand forgets new subpackages; these tests do not.
"""

from __future__ import annotations

import configparser
from pathlib import Path

import pytest
from packaging.version import Version

import hf_ropekv

REPO = Path(__file__).resolve().parents[2]
setupcfg = pytest.importorskip("setuptools.config.setupcfg")


@pytest.fixture(scope="module")
def options() -> dict:
    return setupcfg.read_configuration(str(REPO / "setup.cfg"))["options"]


def _source_dir(package: str, package_dir: dict[str, str]) -> Path:
    """The folder setuptools takes ``package`` from (longest ``package_dir`` prefix wins, as in setuptools)."""
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in package_dir:
            return REPO / package_dir[prefix] / Path(*parts[cut:])
    return REPO / package_dir.get("", "") / Path(*parts)


def test_every_subpackage_of_hf_ropekv_is_listed(options) -> None:
    on_disk = {
        ".".join(init.parent.relative_to(REPO).parts)
        for init in (REPO / "hf_ropekv").rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    missing = sorted(on_disk - set(options["packages"]))
    assert not missing, f"add {missing} to setup.cfg [options] packages, or they are left out of the wheel"


def test_every_listed_package_has_a_source_folder(options) -> None:
    for package in options["packages"]:
        folder = _source_dir(package, options.get("package_dir", {}))
        assert (folder / "__init__.py").is_file(), f"{package} -> {folder} has no __init__.py"


def test_kernels_install_only_inside_hf_ropekv(options) -> None:
    package_dir = options.get("package_dir", {})
    assert "hf_ropekv.kernels" in options["packages"]
    assert _source_dir("hf_ropekv.kernels", package_dir) == REPO / "kernels"
    assert [p for p in options["packages"] if p.split(".")[0] != "hf_ropekv"] == [], "only hf_ropekv.* is installed"
    assert not options.get("py_modules"), "no top-level modules"
    raw = configparser.ConfigParser()
    raw.read(REPO / "setup.cfg")
    assert "find:" not in raw.get("options", "packages"), "find: would install kernels/ as a top-level package"
    assert "" not in package_dir, "a root package_dir would make top-level folders installable"
    assert "tool.setuptools" not in (REPO / "pyproject.toml").read_text(), "packages come from setup.cfg alone"


def test_the_repository_kernels_folder_is_not_importable_as_kernels_while_testing() -> None:
    """Run from the repository root (`python -m pytest`), the root's `kernels/` must not be the top-level module
    `kernels`: transformers imports HuggingFace's `kernels` package when one is installed, and ours would shadow it
    (conftest takes the root off sys.path). Without HF's package, `kernels` is not importable at all."""
    import importlib.util

    spec = importlib.util.find_spec("kernels")
    if spec is not None:
        assert REPO not in Path(spec.origin or "/").resolve().parents, f"the repository's kernels/ shadows: {spec}"


def test_version_has_one_source() -> None:
    """setup.cfg reads hf_ropekv.__version__; both must agree, and it is a valid PEP 440 version."""
    metadata = setupcfg.read_configuration(str(REPO / "setup.cfg"))["metadata"]
    raw = configparser.ConfigParser()
    raw.read(REPO / "setup.cfg")
    assert raw.get("metadata", "version").strip() == "attr: hf_ropekv.__version__"
    assert metadata["version"] == hf_ropekv.__version__
    assert str(Version(hf_ropekv.__version__)) == hf_ropekv.__version__

