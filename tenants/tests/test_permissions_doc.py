"""docs/permissions.md is generated from tenants/roles.py and the page matrix; it must not drift."""

from __future__ import annotations

import pytest
from django.core.management import call_command

from tenants.management.commands.gen_permissions_doc import DOC_PATH, render
from tenants.roles import GRANTABLE_BY, ROLES


def test_permissions_doc_matches_what_the_command_generates():
    assert DOC_PATH.read_text() == render(), "docs/permissions.md is stale: run `python manage.py gen_permissions_doc`"


def test_doc_names_every_role_permission_and_grant_rule():
    text = render()
    for role in ROLES.values():
        assert f"`{role.name}`" in text
        for perm in role.tenant_perms + role.project_perms + role.platform_perms:
            assert f"`{perm}`" in text
    for holder, grantable in GRANTABLE_BY.items():
        assert f"| `{holder}` | " + ", ".join(f"`{g}`" for g in grantable) + " |" in text
    assert "| `tenants:member_list` | GET |" in text


def test_check_mode_fails_when_the_file_differs(tmp_path, monkeypatch):
    from tenants.management.commands import gen_permissions_doc

    stale = tmp_path / "permissions.md"
    stale.write_text("# hand-edited\n")
    monkeypatch.setattr(gen_permissions_doc, "DOC_PATH", stale)
    with pytest.raises(SystemExit) as exit_info:
        call_command("gen_permissions_doc", "--check")
    assert exit_info.value.code == 1
    call_command("gen_permissions_doc")
    assert stale.read_text() == render()
    call_command("gen_permissions_doc", "--check")
