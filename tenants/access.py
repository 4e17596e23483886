"""Who may see and do what: the one visibility helper every view, job and API goes through.

`visible_to(user, Model, action)` returns exactly the rows the user may see for that action,
so an object outside the user's reach is simply absent (and answers 404). Tenant and
project reach comes from guardian object permissions granted to role groups (never global
permissions); platform reach from model-level permissions of platform role groups. The
rules per model are data (RULES); this module must never grant anything itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.apps import apps
from django.db.models import Model, Q, QuerySet
from django.http import Http404
from django.utils import timezone
from guardian.shortcuts import get_objects_for_user

from portal.prepared import Statement


@dataclass(frozen=True)
class Rule:
    platform: tuple[str, ...] = ()  # any of these platform perms sees every row
    project_perm: str = ""  # project object permission that reaches rows of that project
    project_path: str = "project"
    tenant_perm: str = ""  # tenant object permission that reaches rows of that tenant
    tenant_path: str = "tenant"
    vendor_path: str = ""  # path to the Node for vendors holding a valid grant ("" = never)
    vendor_card_path: str = ""  # path to the Accelerator, same idea


RULES: dict[tuple[str, str], Rule] = {
    ("tenants.tenant", "view"): Rule(
        platform=("view_all_tenants", "view_all_usage"),
        tenant_perm="view_tenant", tenant_path="",
    ),
    ("tenants.tenant", "manage"): Rule(
        platform=("manage_tenants",), tenant_perm="manage_tenant_members", tenant_path="",
    ),
    ("tenants.project", "view"): Rule(
        platform=("view_all_tenants", "view_all_usage"), project_perm="view_project", project_path="",
    ),
    ("tenants.project", "manage"): Rule(
        platform=("manage_tenants",), tenant_perm="manage_tenant_projects",
        project_perm="manage_project_members", project_path="",
    ),
    ("tenants.tenantmembership", "view"): Rule(
        platform=("view_all_tenants", "manage_platform_roles"), tenant_perm="manage_tenant_members",
    ),
    ("tenants.projectmembership", "view"): Rule(
        platform=("view_all_tenants", "manage_platform_roles"), tenant_perm="manage_tenant_members",
        project_perm="manage_project_members",
    ),
    ("scheduling.job", "view"): Rule(platform=("view_all_tenants",), project_perm="view_project_jobs"),
    ("scheduling.job", "submit"): Rule(project_perm="submit_job"),
    ("scheduling.job", "cancel"): Rule(platform=("manage_tenants",), project_perm="cancel_project_jobs"),
    ("scheduling.quota", "view"): Rule(
        platform=("view_all_tenants", "view_all_usage"), project_perm="view_project",
        tenant_perm="view_tenant",
    ),
    ("scheduling.node", "view"): Rule(platform=("view_inventory",), vendor_path="pk"),
    ("scheduling.accelerator", "view"): Rule(
        platform=("view_inventory",), vendor_path="node", vendor_card_path="pk",
    ),
    ("scheduling.healthevent", "view"): Rule(
        platform=("view_inventory",), vendor_path="accelerator__node", vendor_card_path="accelerator",
    ),
    ("metering.usagerecord", "view"): Rule(
        platform=("view_all_usage",), project_perm="view_project_usage", tenant_perm="view_tenant_usage",
    ),
    ("portal.auditevent", "view"): Rule(platform=("view_all_audit",), tenant_perm="view_tenant_audit"),
    ("tenants.workorder", "view"): Rule(platform=("operate_inventory", "approve_vendor_grants")),
    ("tenants.vendorgrant", "view"): Rule(platform=("operate_inventory", "approve_vendor_grants")),
    ("tenants.platformroleassignment", "view"): Rule(platform=("manage_platform_roles",)),
    ("metering.alarm", "view"): Rule(
        platform=("view_all_usage", "view_inventory"), project_perm="view_project", tenant_perm="view_tenant_usage",
    ),
    ("metering.budget", "view"): Rule(
        platform=("view_all_usage",), project_perm="view_project_usage", tenant_perm="view_tenant_usage",
    ),
    ("metering.report", "view"): Rule(
        platform=("view_all_usage",), project_perm="view_project_usage", tenant_perm="view_tenant_usage",
    ),
    # serving: tenant-wide services and shared knowledge bases widen these in serving.services
    ("serving.modelservice", "view"): Rule(
        platform=("view_all_tenants",), project_perm="view_project", tenant_perm="manage_tenant_projects",
    ),
    ("serving.application", "view"): Rule(platform=("view_all_tenants",), project_perm="view_project"),
    ("serving.knowledgebase", "view"): Rule(platform=("view_all_tenants",), tenant_perm="manage_tenant_projects"),
    ("serving.apikey", "view"): Rule(platform=("view_all_tenants",), project_perm="manage_api_keys"),
    ("serving.tokenusage", "view"): Rule(
        platform=("view_all_usage",), project_perm="view_project_usage", tenant_perm="view_tenant_usage",
    ),
}


def _cache(user) -> dict:
    # Per request object: the user instance is rebuilt for every request, so a membership
    # change is seen on the next request.
    cache = getattr(user, "_atrium_access", None)
    if cache is None:
        cache = {}
        user._atrium_access = cache
    return cache


def platform_perms(user) -> frozenset[str]:
    if not user.is_authenticated or not user.is_active:
        return frozenset()
    cache = _cache(user)
    if "platform" not in cache:
        from django.contrib.auth.models import Permission

        cache["platform"] = frozenset(
            Permission.objects.filter(
                group__user=user, content_type__app_label="tenants",
                content_type__model="platformroleassignment",
            ).values_list("codename", flat=True)
        )
    return cache["platform"]


def has_platform_perm(user, perm: str) -> bool:
    return perm in platform_perms(user)


def tenant_ids(user, perm: str) -> frozenset[int]:
    """Ids of active-or-suspended tenants on which the user holds `perm` through a role group."""
    if not user.is_authenticated or not user.is_active:
        return frozenset()
    key = ("tenant", perm)
    cache = _cache(user)
    if key not in cache:
        from tenants.models import Tenant

        cache[key] = frozenset(
            get_objects_for_user(
                user, f"tenants.{perm}", Tenant, accept_global_perms=False, with_superuser=False
            ).values_list("pk", flat=True)
        )
    return cache[key]


def project_ids(user, perm: str) -> frozenset[int]:
    if not user.is_authenticated or not user.is_active:
        return frozenset()
    key = ("project", perm)
    cache = _cache(user)
    if key not in cache:
        from tenants.models import Project

        cache[key] = frozenset(
            get_objects_for_user(
                user, f"tenants.{perm}", Project, accept_global_perms=False, with_superuser=False
            ).values_list("pk", flat=True)
        )
    return cache[key]


def vendor_scope(user) -> tuple[frozenset[int], frozenset[int], frozenset[int]]:
    """(whole node ids, card ids, nodes of those cards) of the vendor's valid grants."""
    if not user.is_authenticated:
        return frozenset(), frozenset(), frozenset()
    cache = _cache(user)
    if "vendor" not in cache and cache.get("has_grants") is False:
        cache["vendor"] = (frozenset(), frozenset(), frozenset())  # no grant at all: no need to ask which
    if "vendor" not in cache:
        from tenants.models import VendorGrant

        now = timezone.now()
        grants = VendorGrant.objects.filter(
            vendor=user, approved_by__isnull=False, revoked__isnull=True, starts__lte=now, expires__gt=now
        )
        nodes: set[int] = set()
        cards: set[int] = set()
        card_nodes: set[int] = set()
        for grant in grants.prefetch_related("work_order__nodes", "work_order__accelerators"):
            nodes.update(n.pk for n in grant.work_order.nodes.all())
            for card in grant.work_order.accelerators.all():
                cards.add(card.pk)
                card_nodes.add(card.node_id)
        cache["vendor"] = (frozenset(nodes), frozenset(cards), frozenset(card_nodes))
    return cache["vendor"]


def _model(model_or_qs) -> tuple[type[Model], QuerySet]:
    if isinstance(model_or_qs, QuerySet):
        return model_or_qs.model, model_or_qs
    if isinstance(model_or_qs, str):
        model_or_qs = apps.get_model(model_or_qs)
    return model_or_qs, model_or_qs._default_manager.all()


def _prefix(path: str) -> str:
    return f"{path}__" if path else ""


def visible_to(user, model_or_qs, action: str = "view") -> QuerySet:
    """The rows of a model (or narrowing of a queryset) that `user` may see for `action`."""
    model, qs = _model(model_or_qs)
    rule = RULES.get((model._meta.label_lower, action))
    if rule is None:
        raise LookupError(f"no visibility rule for {model._meta.label_lower} / {action}")
    if user is None or not user.is_authenticated or not user.is_active:
        return qs.none()
    if any(p in platform_perms(user) for p in rule.platform):
        return qs
    cond = Q(pk__in=[])
    if rule.project_perm:
        ids = project_ids(user, rule.project_perm)
        if ids:
            cond |= Q(**{f"{_prefix(rule.project_path)}pk__in": ids})
    if rule.tenant_perm:
        ids = tenant_ids(user, rule.tenant_perm)
        if ids:
            cond |= Q(**{f"{_prefix(rule.tenant_path)}pk__in": ids})
    if rule.vendor_path:
        whole_nodes, cards, card_nodes = vendor_scope(user)
        node_field = "pk" if rule.vendor_path == "pk" else f"{rule.vendor_path}__pk"
        if rule.vendor_card_path:
            # a card is in reach when the work order names it or its whole node
            card_field = "pk" if rule.vendor_card_path == "pk" else f"{rule.vendor_card_path}__pk"
            cond |= Q(**{f"{card_field}__in": cards}) | Q(**{f"{node_field}__in": whole_nodes})
        else:
            cond |= Q(**{f"{node_field}__in": whole_nodes | card_nodes})
    return qs.filter(cond)


def get_visible_or_404(user, model_or_qs, action: str = "view", **lookup):
    """One object within reach, or 404 exactly as if it did not exist."""
    model, qs = _model(model_or_qs)
    try:
        return visible_to(user, qs, action).get(**lookup)
    except (model.DoesNotExist, ValueError):
        raise Http404(f"No {model._meta.verbose_name} matches the given query.") from None


def can(user, perm: str, obj) -> bool:
    """Whether `user` holds project or tenant permission `perm` on `obj` (a Project/Tenant)."""
    from tenants.models import Project, Tenant

    if isinstance(obj, Project):
        return obj.pk in project_ids(user, perm)
    if isinstance(obj, Tenant):
        return obj.pk in tenant_ids(user, perm)
    raise TypeError(f"permission checks are on tenants and projects, not {type(obj).__name__}")


def prime(user) -> None:
    """Fill this request's cache of project_ids(), tenant_ids() and platform_perms() for EVERY
    project, tenant and platform permission in one statement, instead of one guardian query
    per permission asked.

    A page that asks about many permissions (the navigation alone asks about ~8, the dashboard
    about ~6 more) calls this first. The answers are exactly those of project_ids(),
    tenant_ids() and platform_perms(): object permissions through role groups or held directly,
    no global perms, platform permissions through role groups; nothing for an inactive or
    anonymous user. Same per-request lifetime as the rest of the cache.
    """
    if user is None or not user.is_authenticated or not user.is_active:
        return
    from tenants.models import Project, Tenant

    cache = _cache(user)
    codenames = {kind: [c for c, _ in model._meta.permissions] for kind, model in (("project", Project),
                                                                                   ("tenant", Tenant))}
    if "platform" in cache and all((kind, c) in cache for kind, cs in codenames.items() for c in cs):
        return
    found: dict[str, dict[str, set[int]]] = {kind: {c: set() for c in cs} for kind, cs in codenames.items()}
    platform: set[str] = set()
    for kind, codename, obj_id in _PRIME.fetchall(_prime_params(user)):
        if kind == "platform":
            platform.add(codename)
        else:
            found[kind].setdefault(codename, set()).add(obj_id)
    for kind, by_codename in found.items():
        for codename, ids in by_codename.items():
            cache.setdefault((kind, codename), frozenset(ids))
    cache.setdefault("platform", frozenset(platform))


def _prime_sql() -> str:
    """The statement prime() runs, written from the models' metadata once per process (its
    parameters come from _prime_params) and prepared once per connection (portal.prepared):
    on every page the ORM compiling two UNIONs and the platform query, and PostgreSQL planning
    them (~2.5 ms), cost more than running them. The user's groups come first, materialised,
    so each grant table is read through its group index, not scanned for every grant of a type."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group, Permission

    from tenants.models import (
        ProjectGroupObjectPermission,
        ProjectUserObjectPermission,
        TenantGroupObjectPermission,
        TenantUserObjectPermission,
    )

    perm = Permission._meta.db_table
    user_groups = get_user_model()._meta.get_field("groups").remote_field.through._meta.db_table
    group_perms = Group._meta.get_field("permissions").remote_field.through._meta.db_table
    groups = (f"(WITH mine AS MATERIALIZED (SELECT group_id FROM {user_groups} WHERE user_id = %(user)s) "  # noqa: S608 # nosec B608 # table names from model metadata
              "SELECT group_id FROM mine)")
    parts = []
    for kind, via_group, via_user in (("project", ProjectGroupObjectPermission, ProjectUserObjectPermission),
                                      ("tenant", TenantGroupObjectPermission, TenantUserObjectPermission)):
        parts.append(
            f"SELECT '{kind}', p.codename, g.content_object_id FROM {via_group._meta.db_table} g "  # noqa: S608 # nosec B608 # table names from model metadata, values are parameters
            f"JOIN {perm} p ON p.id = g.permission_id "
            f"WHERE g.group_id IN {groups} AND p.content_type_id = %({kind}_ct)s"
        )
        parts.append(
            f"SELECT '{kind}', p.codename, u.content_object_id FROM {via_user._meta.db_table} u "  # noqa: S608 # nosec B608 # table names from model metadata, values are parameters
            f"JOIN {perm} p ON p.id = u.permission_id "
            f"WHERE u.user_id = %(user)s AND p.content_type_id = %({kind}_ct)s"
        )
    parts.append(
        f"SELECT 'platform', p.codename, 0 FROM {perm} p JOIN {group_perms} gp ON gp.permission_id = p.id "  # noqa: S608 # nosec B608 # table names from model metadata, values are parameters
        f"WHERE gp.group_id IN {groups} AND p.content_type_id = %(platform_ct)s"
    )
    return " UNION ALL ".join(parts)


_PRIME = Statement(_prime_sql)


def _prime_params(user) -> dict:
    from django.contrib.contenttypes.models import ContentType

    from tenants.models import PlatformRoleAssignment, Project, Tenant

    get_ct = ContentType.objects.get_for_model  # cached per process by Django, cleared when tables are
    return {"user": user.pk, "project_ct": get_ct(Project).pk, "tenant_ct": get_ct(Tenant).pk,
            "platform_ct": get_ct(PlatformRoleAssignment).pk}


def holds_project_perm(user, perm: str, project_id: int) -> bool:
    """The same answer as `can(user, perm, project)` for ONE project, in one indexed query.

    For hot paths that ask once per request about one project: guardian's get_objects_for_user
    builds and runs a query over every project the user reaches, ~10x the cost. Same sources as
    project_ids(): the project object permission through a role group or held directly, no
    global perms. Never cached across requests, so a membership that ends stops the next call.
    """
    if user is None or not user.is_authenticated or not user.is_active:
        return False
    known = _cache(user).get(("project", perm))
    if known is not None:
        return project_id in known
    from django.db import connection

    sql = "SELECT " + project_perm_sql(user="%(user)s", project="%(project)s", perm="%(perm)s")
    with connection.cursor() as cur:
        # nosemgrep: atrium-raw-sql-string-formatting -- table names from model metadata, values are parameters
        cur.execute(sql, {"user": user.pk, "project": project_id, "perm": perm})
        return bool(cur.fetchone()[0])


def project_perm_sql(*, user: str, project: str, perm: str) -> str:
    """The SQL condition holds_project_perm() evaluates: `user` holds project permission `perm`
    on `project`, through a role group or directly, no global perms.

    The arguments are SQL expressions written by the caller (parameter placeholders or column
    names), never data. Hand-written because it runs at every gateway call, where the ORM's query
    compilation costs more than the query; the gateway's one-statement key check
    (serving.services.authenticate_key) embeds this same condition, so both answer alike.
    """
    from django.contrib.auth import get_user_model

    from tenants.models import Project, ProjectGroupObjectPermission, ProjectUserObjectPermission

    permission = ProjectGroupObjectPermission._meta.get_field("permission").related_model
    perm_table = permission._meta.db_table
    ct_table = permission._meta.get_field("content_type").related_model._meta.db_table
    user_groups = get_user_model()._meta.get_field("groups").remote_field.through._meta.db_table
    app_label, model = Project._meta.app_label, Project._meta.model_name
    if not (app_label.isidentifier() and model.isidentifier()):  # written into the text as literals
        raise ValueError(f"unexpected model label {app_label}.{model}")
    label = f"ct.app_label = '{app_label}' AND ct.model = '{model}'"
    return (
        f"(EXISTS (SELECT 1 FROM {ProjectGroupObjectPermission._meta.db_table} g "  # noqa: S608 # nosec B608 # table names from model metadata, values are the caller's placeholders
        f"JOIN {user_groups} ug ON ug.group_id = g.group_id "
        f"JOIN {perm_table} p ON p.id = g.permission_id JOIN {ct_table} ct ON ct.id = p.content_type_id "
        f"WHERE g.content_object_id = {project} AND ug.user_id = {user} AND p.codename = {perm} AND {label}"
        f") OR EXISTS (SELECT 1 FROM {ProjectUserObjectPermission._meta.db_table} u "
        f"JOIN {perm_table} p ON p.id = u.permission_id JOIN {ct_table} ct ON ct.id = p.content_type_id "
        f"WHERE u.content_object_id = {project} AND u.user_id = {user} AND p.codename = {perm} AND {label}))"
    )


def is_vendor_only(user) -> bool:
    """A vendor account: holds grants and no tenant, project or platform role."""
    if not user.is_authenticated:
        return False
    cache = _cache(user)
    if "vendor_only" not in cache:
        cache["has_grants"] = user.vendor_grants.exists()  # any grant, valid or not (vendor_scope reads it)
        cache["vendor_only"] = (
            cache["has_grants"]
            and not user.tenant_memberships.exists()
            and not user.project_memberships.exists()
            and not user.platform_roles.exists()
        )
    return cache["vendor_only"]


def session_still_valid(user) -> bool:
    """A vendor-only account keeps its session only while one of its grants is valid."""
    if not is_vendor_only(user):
        return True
    return any(vendor_scope(user))
