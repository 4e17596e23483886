"""Where the CLI keeps the server URL and token: $XDG_CONFIG_HOME/atrium/config.json (or
~/.config/atrium/config.json), written with mode 0600 in a 0700 directory. ATRIUM_URL and
ATRIUM_TOKEN in the environment override the file (for CI jobs); nothing else reads the token.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "atrium" / "config.json"


def load() -> dict:
    path = config_path()
    data: dict = {}
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
    if os.environ.get("ATRIUM_URL"):
        data["url"] = os.environ["ATRIUM_URL"]
    if os.environ.get("ATRIUM_TOKEN"):
        data["token"] = os.environ["ATRIUM_TOKEN"]
    return data


def save(data: dict) -> Path:
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    # create with 0600 from the start: the token must never be readable by others, not even briefly
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(data, fh, indent=2)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


def forget() -> bool:
    path = config_path()
    if path.exists():
        path.unlink()
        return True
    return False
