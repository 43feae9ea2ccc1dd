"""The install page's commands match the project: the package's name, its extras, the torch pin, and a wheel that
holds every sub-package (`pip install` of a wheel missing one fails at the first import of it)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "get-started" / "install.md"


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_wheel_lists_every_sub_package_of_the_package():
    listed = set(_project()["tool"]["setuptools"]["packages"])
    folders = {
        "lightning_grpo." + ".".join(init.parent.relative_to(ROOT / "lightning_grpo").parts)
        for init in (ROOT / "lightning_grpo").rglob("__init__.py")
        if init.parent != ROOT / "lightning_grpo"
    }
    missing = sorted(folders - listed)
    assert not missing, (
        f"pyproject.toml's [tool.setuptools] packages lacks {missing}: a built wheel would not hold them"
    )


def test_install_page_names_the_package_its_extras_and_the_torch_pin():
    page = PAGE.read_text()
    project = _project()["project"]
    assert f"`{project['name']}`" in page
    for extra in project["optional-dependencies"]:
        assert f"`{extra}`" in page, f"the install page does not mention the `{extra}` extra"
    for extra in re.findall(r'pip install -e "\.\[(\w+)\]"', page):
        assert extra in project["optional-dependencies"], f"the install page installs an unknown extra [{extra}]"
    torch_pin = re.search(r'pip install "(torch==[\d.]+)"', (ROOT / "scripts" / "setup.sh").read_text())
    assert torch_pin and f"pip install {torch_pin.group(1)}" in page, "the page's torch pin differs from setup.sh's"
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M)
    assert version and f"lightning_grpo-{version.group(1)}-py3-none-any.whl" in page
