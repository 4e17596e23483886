"""docs/configuration.md documents every environment variable portal/settings.py reads."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_read_from_the_environment_is_documented():
    settings_py = (ROOT / "portal" / "settings.py").read_text()
    names = set(re.findall(r'env\.[a-z_]+\("([A-Z][A-Z0-9_]+)"', settings_py))
    assert len(names) > 20, "the settings file should read its variables through env.*()"
    doc = (ROOT / "docs" / "configuration.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"document these in docs/configuration.md: {missing}"
