"""The fast permission paths of tenants.access give exactly guardian's answers.

`prime(user)` fills the per-request cache of project_ids()/tenant_ids()/platform_perms() for every
permission in one statement, and `holds_project_perm()` answers one (user, perm, project) question in one query
(the API gateway asks it at every call). Both must agree with the guardian-based functions for
every role, and must see a membership change at the next question."""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext

from tenants import access
from tenants import services as tenancy
from tenants.models import Project, ProjectMembership, Tenant

PROJECT_PERMS = [c for c, _ in Project._meta.permissions]
TENANT_PERMS = [c for c, _ in Tenant._meta.permissions]


def everyone(org):
    people = [p for per in org.people.values() for p in per.values()]
    return people + [org.admin, org.ops, org.security, org.finance, org.auditor]


def fresh(user):
    return get_user_model().objects.get(pk=user.pk)  # an empty per-request cache


def test_prime_gives_guardians_answers_for_every_role_and_permission(org):
    access.prime(fresh(org.admin))  # the first call of a process loads the content types it needs, once
    for person in everyone(org):
        primed = fresh(person)
        with CaptureQueriesContext(connection) as ctx:
            access.prime(primed)
        assert len(ctx.captured_queries) == 1
        slow = fresh(person)
        with CaptureQueriesContext(connection) as ctx:  # everything now comes from the cache
            answers = {perm: access.project_ids(primed, perm) for perm in PROJECT_PERMS}
            answers.update({("t", perm): access.tenant_ids(primed, perm) for perm in TENANT_PERMS})
            platform = access.platform_perms(primed)
        assert ctx.captured_queries == []
        assert platform == access.platform_perms(slow), person.username
        for perm in PROJECT_PERMS:
            assert answers[perm] == access.project_ids(slow, perm), (person.username, perm)
        for perm in TENANT_PERMS:
            assert answers[("t", perm)] == access.tenant_ids(slow, perm), (person.username, perm)
    # a tenant admin holds something, so the comparison above is not between empty sets only
    admin = fresh(org.people["alpha"]["admin"])
    access.prime(admin)
    assert org.tenants["alpha"].pk in access.tenant_ids(admin, "manage_tenant_members")
    ops = fresh(org.ops)  # and a platform role holds platform permissions
    access.prime(ops)
    assert "operate_inventory" in access.platform_perms(ops)


def test_prime_gives_nothing_to_an_inactive_user(org):
    user = fresh(org.people["alpha"]["user"])
    user.is_active = False
    access.prime(user)
    assert access.project_ids(user, "submit_job") == frozenset()


def test_holds_project_perm_agrees_with_can_and_sees_a_membership_end_at_once(org):
    projects = list(org.projects.values())
    for person in everyone(org):
        for project in projects:
            for perm in PROJECT_PERMS:
                expected = access.can(fresh(person), perm, project)
                assert access.holds_project_perm(fresh(person), perm, project.pk) is expected, (
                    person.username, project, perm)
    user = org.people["alpha"]["user"]
    project = org.projects["alpha"]
    assert access.holds_project_perm(fresh(user), "use_model_services", project.pk)
    tenancy.remove_project_member(org.admin, ProjectMembership.objects.get(user=user, project=project))
    assert not access.holds_project_perm(fresh(user), "use_model_services", project.pk)


def test_a_permission_held_directly_not_through_a_group_counts_too(org, make_user):
    from guardian.shortcuts import assign_perm

    loner = make_user("direct-holder")
    project = org.projects["beta"]
    assert not access.holds_project_perm(fresh(loner), "view_project", project.pk)
    assign_perm("tenants.view_project", loner, project)
    assert access.holds_project_perm(fresh(loner), "view_project", project.pk)
    primed = fresh(loner)
    access.prime(primed)
    assert access.project_ids(primed, "view_project") == access.project_ids(fresh(loner), "view_project") == {project.pk}
