"""What `pip install hybridkv` (not editable) ships: every subpackage of hybridkv/ is listed in pyproject.toml's
packages (a missing one imports in a checkout and fails in an install: hybridkv.lora once did)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_in_the_setuptools_packages():
    # The list as written (tomllib is Python 3.11's; hybridkv runs on 3.10 too).
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(ast.literal_eval(re.search(r"^packages = (\[[^\]]*\])", text, re.MULTILINE).group(1)))
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "hybridkv").rglob("__init__.py")}
    assert found == listed, f"add {sorted(found - listed)} / drop {sorted(listed - found)} in pyproject.toml"
