"""Reading the page matrix (tenants/permission_matrix.yaml): which status each role gets from
each URL. Shared by the cross-tenant matrix test and the permissions doc generator, so the
two can never disagree about what the file says. It only reads; it never decides access.
"""

from __future__ import annotations

import fnmatch
from functools import lru_cache
from pathlib import Path

import yaml

MATRIX_PATH = Path(__file__).resolve().parent / "permission_matrix.yaml"
METHODS = ("get", "post")


@lru_cache(maxsize=1)
def load() -> dict:
    with MATRIX_PATH.open() as fh:
        return yaml.safe_load(fh)


def roles() -> list[str]:
    return list(load()["roles"])


def urls() -> dict[str, dict]:
    return load()["urls"]


def covered_elsewhere() -> dict[str, dict]:
    """URL-name patterns (fnmatch) left out of the page matrix on purpose -> {why, tests}.

    Only for URLs that are not session pages (the JSON API, the key-authenticated gateway): each
    names the test files (optionally `path::test_name`) that check their reach instead."""
    return load().get("covered_elsewhere") or {}


def covered_by(url_name: str) -> list[str]:
    """The covered_elsewhere patterns that match `url_name` (normally none or one)."""
    return [p for p in covered_elsewhere() if fnmatch.fnmatchcase(url_name, p)]


def kwargs_of(url_name: str) -> tuple[dict[str, str], dict[str, str]]:
    """(kwarg -> object kind, kwarg -> literal value) of a URL entry."""
    spec = urls()[url_name]
    return dict(spec.get("kwargs") or {}), {k: str(v) for k, v in (spec.get("literals") or {}).items()}


def xfail(url_name: str, method: str, role: str) -> str | None:
    """The reason when the matrix knowingly expects a status the view does not give yet.

    Keys are "<method> <role>" (e.g. "get finance"); the status written in the matrix is the
    intended one, so the doc shows the target and the test reports the case as a known gap."""
    reasons = urls()[url_name].get("xfail") or {}
    return reasons.get(f"{method} {role}")


def expected(url_name: str, method: str, role: str) -> str | None:
    """The expected status ("200", "login", ...) or None when the URL has no such method entry.

    A post-only URL answers 405 to a GET from any signed-in role (the matrix need not say so).
    """
    spec = urls()[url_name]
    matrix = load()
    statuses = spec.get(method)
    if statuses is None:
        if method == "get" and spec.get("post_only"):
            statuses = {"default": 405}
        else:
            return None
    if role in statuses:
        return str(statuses[role])
    if role in matrix.get("defaults", {}):
        return str(matrix["defaults"][role])
    for group, members in matrix.get("groups", {}).items():
        if group in statuses and role in members:
            return str(statuses[group])
    return str(statuses["default"])
