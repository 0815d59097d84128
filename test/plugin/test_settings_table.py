"""The README's runtime-switches table is generated from settings.py, and settings.py lists every variable read."""

from __future__ import annotations

import re

from conftest import REPO_ROOT

from sglang_dsv41.plugin import settings

PACKAGE = REPO_ROOT / "python" / "sglang_dsv41"
# Variables the package sets for itself (never an operator's switch).
INTERNAL = {"SGLANG_DSV41_INNER_APP_PATH"}


def test_readme_table_is_the_generated_one():
    readme = (REPO_ROOT / "README.md").read_text()
    assert settings.replace_table(readme) == readme, (
        "README.md's runtime-switches table is stale: run `make settings-doc`")


def test_every_variable_the_package_names_is_documented():
    listed = {name for s in settings.SETTINGS for name in s.names}
    named = set()
    for path in PACKAGE.rglob("*.py"):
        named |= set(re.findall(r'"(SGLANG_DSV41_[A-Z0-9_]+)"', path.read_text()))
    assert named - INTERNAL, "the scan found no variable at all"
    assert named - INTERNAL <= listed, f"undocumented: {sorted(named - INTERNAL - listed)}"


def test_every_documented_variable_is_read_somewhere():
    sources = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "settings.py")
    for setting in settings.SETTINGS:
        for name in setting.names:
            assert f'"{name}"' in sources, f"{name} is documented but nothing in the package names it"


def test_a_changed_meaning_makes_the_table_stale(monkeypatch):
    readme = (REPO_ROOT / "README.md").read_text()
    first = settings.SETTINGS[0]
    changed = settings.Setting(first.names, first.default, first.meaning + " (changed)")
    monkeypatch.setattr(settings, "SETTINGS", (changed,) + settings.SETTINGS[1:])
    assert settings.replace_table(readme) != readme
