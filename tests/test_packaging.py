"""What `pip install hybridkv` (not editable) ships: every subpackage of hybridkv/ is listed in pyproject.toml's
packages (a missing one imports in a checkout and fails in an install: hybridkv.lora once did)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_in_the_setuptools_packages():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "hybridkv").rglob("__init__.py")
    }
    assert found == listed, f"add {sorted(found - listed)} / drop {sorted(listed - found)} in pyproject.toml"
