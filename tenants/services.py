"""Domain operations on tenants, projects, memberships and platform roles.

The only place that changes these rows. Every function takes the acting user, checks the
permission against tenants.roles, makes the change in one transaction with its audit event,
and keeps the derived role groups and guardian object permissions in step. A tenant admin
can never reach another tenant, raise its own quota or grant a role it does not hold.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group, Permission
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone
from guardian.shortcuts import assign_perm

from portal import audit
from portal.services import deny, require_sudo
from tenants import access
from tenants.models import (
    ExternalIdentity,
    PlatformRoleAssignment,
    Project,
    ProjectMembership,
    Tenant,
    TenantMembership,
    TenantState,
    VendorGrant,
    WorkOrder,
)
from tenants.roles import GRANTABLE_BY, PLATFORM_ROLES, PROJECT_ROLES, ROLES, TENANT_ROLES, group_name

User = get_user_model()


# --- derived role groups --------------------------------------------------------------


def _tenant_group(tenant: Tenant, role: str) -> Group:
    return Group.objects.get_or_create(name=group_name("tenant", tenant.pk, role))[0]


def _project_group(project: Project, role: str) -> Group:
    return Group.objects.get_or_create(name=group_name("project", project.pk, role))[0]


def platform_group(role: str) -> Group:
    group, created = Group.objects.get_or_create(name=group_name("platform", None, role))
    if created:
        perms = Permission.objects.filter(
            content_type__app_label="tenants", content_type__model="platformroleassignment",
            codename__in=ROLES[role].platform_perms,
        )
        group.permissions.set(perms)
    return group


def sync_platform_groups() -> None:
    """Make the platform groups' permissions match the role table (after a role edit)."""
    for role in PLATFORM_ROLES:
        group = platform_group(role)
        group.permissions.set(
            Permission.objects.filter(
                content_type__app_label="tenants", content_type__model="platformroleassignment",
                codename__in=ROLES[role].platform_perms,
            )
        )


def _grant_tenant_groups(tenant: Tenant) -> None:
    for role in TENANT_ROLES:
        group = _tenant_group(tenant, role)
        for perm in ROLES[role].tenant_perms:
            assign_perm(f"tenants.{perm}", group, tenant)


def _grant_project_groups(project: Project) -> None:
    for role in PROJECT_ROLES:
        group = _project_group(project, role)
        for perm in ROLES[role].project_perms:
            assign_perm(f"tenants.{perm}", group, project)
    # tenant roles reach every project of their tenant
    for role in TENANT_ROLES:
        group = _tenant_group(project.tenant, role)
        for perm in ROLES[role].project_perms:
            assign_perm(f"tenants.{perm}", group, project)


# --- permission checks ----------------------------------------------------------------


def _held_roles(user, tenant: Tenant | None = None, project: Project | None = None) -> set[str]:
    roles = set(PlatformRoleAssignment.objects.filter(user=user).values_list("role", flat=True))
    if tenant is not None:
        roles |= set(TenantMembership.objects.filter(user=user, tenant=tenant).values_list("role", flat=True))
    if project is not None:
        roles |= set(ProjectMembership.objects.filter(user=user, project=project).values_list("role", flat=True))
    return roles


def _manages_members(actor, tenant: Tenant, project: Project | None = None) -> bool:
    """Who may add, change and remove members: platform admins, the tenant's admins and, for a
    project, its project admins."""
    return (
        access.has_platform_perm(actor, "manage_tenants")
        or access.can(actor, "manage_tenant_members", tenant)
        or (project is not None and access.can(actor, "manage_project_members", project))
    )


def _may_grant(actor, role: str, tenant: Tenant | None, project: Project | None) -> bool:
    """Never a role beyond one's own: GRANTABLE_BY lists what each held role may hand out."""
    if role in PLATFORM_ROLES:
        return access.has_platform_perm(actor, "manage_platform_roles")
    if access.has_platform_perm(actor, "manage_tenants"):
        return True
    return any(role in GRANTABLE_BY.get(held, ()) for held in _held_roles(actor, tenant, project))


# --- tenants and projects ---------------------------------------------------------------


def create_tenant(actor, *, slug: str, name: str) -> Tenant:
    if not access.has_platform_perm(actor, "manage_tenants"):
        deny(actor, "tenant.create", "only platform admins create tenants", target_label=slug)
    tenant = Tenant(slug=slug, name=name)
    tenant.full_clean()
    with transaction.atomic():
        tenant.save()
        _grant_tenant_groups(tenant)
        audit.record("tenant.create", actor=actor, target=tenant, tenant=tenant, after={"slug": slug, "name": name})
    return tenant


def set_tenant_state(actor, tenant: Tenant, state: str) -> Tenant:
    if not access.has_platform_perm(actor, "manage_tenants"):
        deny(actor, "tenant.state", "only platform admins suspend tenants", target=tenant, tenant=tenant)
    if state not in TenantState.values:
        raise ValidationError({"state": f"unknown state {state!r}"})
    with transaction.atomic():
        before = tenant.state
        tenant.state = state
        tenant.save(update_fields=["state"])
        audit.record("tenant.state", actor=actor, target=tenant, tenant=tenant,
                     before={"state": before}, after={"state": state})
    return tenant


def create_project(actor, tenant: Tenant, *, slug: str, name: str, project_class: str, cost_centre: str = "") -> Project:
    if not (access.has_platform_perm(actor, "manage_tenants") or access.can(actor, "manage_tenant_projects", tenant)):
        if tenant.pk not in access.tenant_ids(actor, "view_tenant"):
            deny(actor, "project.create", "tenant not in reach", target_label=slug)
        deny(actor, "project.create", "only the tenant's admins create projects", target=tenant, tenant=tenant)
    project = Project(tenant=tenant, slug=slug, name=name, project_class=project_class, cost_centre=cost_centre)
    project.full_clean()
    with transaction.atomic():
        project.save()
        _grant_project_groups(project)
        audit.record("project.create", actor=actor, target=project, project=project,
                     after={"slug": slug, "class": project_class, "cost_centre": cost_centre})
    return project


def archive_project(actor, project: Project) -> Project:
    if not (access.has_platform_perm(actor, "manage_tenants") or access.can(actor, "manage_tenant_projects", project.tenant)):
        deny(actor, "project.archive", "only the tenant's admins archive projects", target=project, project=project)
    with transaction.atomic():
        project.archived = timezone.now()
        project.save(update_fields=["archived"])
        audit.record("project.archive", actor=actor, target=project, project=project)
    return project


# --- memberships ------------------------------------------------------------------------


def add_tenant_member(actor, tenant: Tenant, user, role: str, *, source: str = "local") -> TenantMembership:
    if role not in TENANT_ROLES:
        raise ValidationError({"role": f"{role!r} is not a tenant role"})
    if source == "local":
        if not _manages_members(actor, tenant):
            deny(actor, "membership.grant", "not an admin of this tenant", target=tenant, tenant=tenant)
        if not _may_grant(actor, role, tenant, None):
            deny(actor, "membership.grant", f"cannot grant {role}", target=tenant, tenant=tenant)
    with transaction.atomic():
        membership, created = TenantMembership.objects.get_or_create(
            user=user, tenant=tenant, role=role, defaults={"source": source}
        )
        if created:
            user.groups.add(_tenant_group(tenant, role))
            audit.record("membership.grant", actor=actor, target=tenant, tenant=tenant,
                         target_label=f"{user.get_username()} as {role} of {tenant.slug}",
                         after={"user": user.get_username(), "role": role, "source": source})
    return membership


def remove_tenant_member(actor, membership: TenantMembership, *, source: str = "local") -> None:
    tenant = membership.tenant
    if source == "local" and not _manages_members(actor, tenant):
        deny(actor, "membership.revoke", "not an admin of this tenant", target=tenant, tenant=tenant)
    with transaction.atomic():
        membership.user.groups.remove(_tenant_group(tenant, membership.role))
        audit.record("membership.revoke", actor=actor, target=tenant, tenant=tenant,
                     target_label=f"{membership.user.get_username()} as {membership.role} of {tenant.slug}",
                     before={"user": membership.user.get_username(), "role": membership.role})
        membership.delete()


def add_project_member(actor, project: Project, user, role: str, *, source: str = "local") -> ProjectMembership:
    if role not in PROJECT_ROLES:
        raise ValidationError({"role": f"{role!r} is not a project role"})
    if source == "local":
        if not _manages_members(actor, project.tenant, project):
            deny(actor, "membership.grant", "not an admin of this project", target=project, project=project)
        if not _may_grant(actor, role, project.tenant, project):
            deny(actor, "membership.grant", f"cannot grant {role}", target=project, project=project)
    with transaction.atomic():
        membership, created = ProjectMembership.objects.get_or_create(
            user=user, project=project, role=role, defaults={"source": source, "tenant": project.tenant}
        )
        if created:
            user.groups.add(_project_group(project, role))
            # a project member is a member of its tenant too (sees the tenant's name)
            if not TenantMembership.objects.filter(user=user, tenant=project.tenant).exists():
                TenantMembership.objects.create(user=user, tenant=project.tenant, role="member", source=source)
                user.groups.add(_tenant_group(project.tenant, "member"))
            audit.record("membership.grant", actor=actor, target=project, project=project,
                         target_label=f"{user.get_username()} as {role} of {project}",
                         after={"user": user.get_username(), "role": role, "source": source})
    return membership


def remove_project_member(actor, membership: ProjectMembership, *, source: str = "local") -> None:
    project = membership.project
    if source == "local" and not _manages_members(actor, project.tenant, project):
        deny(actor, "membership.revoke", "not an admin of this project", target=project, project=project)
    with transaction.atomic():
        membership.user.groups.remove(_project_group(project, membership.role))
        audit.record("membership.revoke", actor=actor, target=project, project=project,
                     target_label=f"{membership.user.get_username()} as {membership.role} of {project}",
                     before={"user": membership.user.get_username(), "role": membership.role})
        membership.delete()


def grant_platform_role(actor, user, role: str, *, source: str = "local", bootstrap: bool = False) -> PlatformRoleAssignment:
    """Grant a platform role; needs `manage_platform_roles` and a recent re-authentication.

    `bootstrap` is only for the very first platform admin of an empty installation
    (createsuperuser-like), used by management commands.
    """
    if role not in PLATFORM_ROLES:
        raise ValidationError({"role": f"{role!r} is not a platform role"})
    if source == "local" and not bootstrap:
        if not access.has_platform_perm(actor, "manage_platform_roles"):
            deny(actor, "platform_role.grant", f"cannot grant {role}", target_label=user.get_username())
        require_sudo(actor, "platform_role.grant", target_label=user.get_username())
    with transaction.atomic():
        assignment, created = PlatformRoleAssignment.objects.get_or_create(
            user=user, role=role, defaults={"source": source}
        )
        if created:
            user.groups.add(platform_group(role))
            audit.record("platform_role.grant", actor=actor, target_type="auth.user", target_id=str(user.pk),
                         target_label=f"{user.get_username()} as {role}", after={"role": role, "source": source})
    return assignment


def revoke_platform_role(actor, assignment: PlatformRoleAssignment, *, source: str = "local") -> None:
    if source == "local":
        if not access.has_platform_perm(actor, "manage_platform_roles"):
            deny(actor, "platform_role.revoke", "cannot revoke platform roles",
                 target_label=assignment.user.get_username())
        require_sudo(actor, "platform_role.revoke", target_label=assignment.user.get_username())
    with transaction.atomic():
        assignment.user.groups.remove(platform_group(assignment.role))
        audit.record("platform_role.revoke", actor=actor, target_type="auth.user",
                     target_id=str(assignment.user_id),
                     target_label=f"{assignment.user.get_username()} as {assignment.role}",
                     before={"role": assignment.role})
        assignment.delete()


def change_tenant_member_role(actor, membership: TenantMembership, role: str) -> TenantMembership:
    """Move a tenant member to another tenant role (one audit event, not a grant plus a revoke)."""
    tenant = membership.tenant
    if role not in TENANT_ROLES:
        raise ValidationError({"role": f"{role!r} is not a tenant role"})
    if not _manages_members(actor, tenant):
        deny(actor, "membership.change", "not an admin of this tenant", target=tenant, tenant=tenant)
    if not _may_grant(actor, role, tenant, None):
        deny(actor, "membership.change", f"cannot grant {role}", target=tenant, tenant=tenant)
    if role == membership.role:
        return membership
    if TenantMembership.objects.filter(user=membership.user, tenant=tenant, role=role).exists():
        raise ValidationError({"role": f"{membership.user.get_username()} already holds {role} here"})
    with transaction.atomic():
        before = membership.role
        membership.user.groups.remove(_tenant_group(tenant, before))
        membership.role = role
        membership.source = "local"
        membership.save(update_fields=["role", "source"])
        membership.user.groups.add(_tenant_group(tenant, role))
        audit.record("membership.change", actor=actor, target=tenant, tenant=tenant,
                     target_label=f"{membership.user.get_username()} of {tenant.slug}",
                     before={"user": membership.user.get_username(), "role": before},
                     after={"user": membership.user.get_username(), "role": role})
    return membership


def change_project_member_role(actor, membership: ProjectMembership, role: str) -> ProjectMembership:
    project = membership.project
    if role not in PROJECT_ROLES:
        raise ValidationError({"role": f"{role!r} is not a project role"})
    if not _manages_members(actor, project.tenant, project):
        deny(actor, "membership.change", "not an admin of this project", target=project, project=project)
    if not _may_grant(actor, role, project.tenant, project):
        deny(actor, "membership.change", f"cannot grant {role}", target=project, project=project)
    if role == membership.role:
        return membership
    if ProjectMembership.objects.filter(user=membership.user, project=project, role=role).exists():
        raise ValidationError({"role": f"{membership.user.get_username()} already holds {role} here"})
    with transaction.atomic():
        before = membership.role
        membership.user.groups.remove(_project_group(project, before))
        membership.role = role
        membership.source = "local"
        membership.save(update_fields=["role", "source"])
        membership.user.groups.add(_project_group(project, role))
        audit.record("membership.change", actor=actor, target=project, project=project,
                     target_label=f"{membership.user.get_username()} of {project}",
                     before={"user": membership.user.get_username(), "role": before},
                     after={"user": membership.user.get_username(), "role": role})
    return membership


def find_user(identifier: str):
    """The one account a person means by a username, an e-mail address or an OIDC subject.

    Ambiguity is an error rather than a guess: adding the wrong person to a tenant is a leak.
    """
    identifier = identifier.strip()
    if not identifier:
        raise ValidationError({"who": "give a username, an e-mail address or an SSO subject"})
    candidates = set(User.objects.filter(username=identifier).values_list("pk", flat=True))
    if not candidates:
        candidates = set(User.objects.filter(email__iexact=identifier).values_list("pk", flat=True))
    if not candidates:
        candidates = set(ExternalIdentity.objects.filter(subject=identifier).values_list("user_id", flat=True))
    if not candidates:
        raise ValidationError({"who": f"no account is known as {identifier!r}"})
    if len(candidates) > 1:
        raise ValidationError({"who": f"{identifier!r} names {len(candidates)} accounts; use the username"})
    return User.objects.get(pk=candidates.pop())


# --- vendor access ----------------------------------------------------------------------


def _is_plain_vendor_account(user) -> bool:
    return not (
        user.tenant_memberships.exists() or user.project_memberships.exists() or user.platform_roles.exists()
        or user.is_superuser or user.is_staff
    )


def open_work_order(actor, *, title: str, reason: str, nodes=(), accelerators=()) -> WorkOrder:
    """Ops opens a work order naming the nodes and/or cards a vendor will need to touch."""
    if not access.has_platform_perm(actor, "operate_inventory"):
        deny(actor, "workorder.open", "only ops engineers open work orders", target_label=title[:300])
    nodes, accelerators = list(nodes), list(accelerators)
    if not nodes and not accelerators:
        raise ValidationError({"nodes": "name at least one node or card the vendor works on"})
    order = WorkOrder(title=title, reason=reason, opened_by=actor)
    order.full_clean(exclude=["opened_by"])
    with transaction.atomic():
        order.save()
        order.nodes.set(nodes)
        order.accelerators.set(accelerators)
        audit.record("workorder.open", actor=actor, target=order, reason=reason,
                     after={"nodes": [n.name for n in nodes], "cards": [c.uuid for c in accelerators]})
    return order


def request_vendor_grant(actor, *, work_order: WorkOrder, vendor, starts, expires) -> VendorGrant:
    """Ops asks for a vendor's time-limited access; it does nothing until someone else approves."""
    if not access.has_platform_perm(actor, "operate_inventory"):
        deny(actor, "vendor.grant.request", "only ops engineers request vendor access", target=work_order)
    if work_order.closed is not None:
        raise ValidationError({"work_order": "this work order is closed"})
    if vendor.pk == actor.pk:
        raise ValidationError({"vendor": "you cannot request vendor access for yourself"})
    if not _is_plain_vendor_account(vendor):
        # a vendor grant on an account with roles would mix vendor reach into a staff session
        raise ValidationError({"vendor": f"{vendor.get_username()} holds roles; vendors use a separate account"})
    if expires <= starts:
        raise ValidationError({"expires": "access must end after it starts"})
    if expires <= timezone.now():
        raise ValidationError({"expires": "this grant would already have ended"})
    grant = VendorGrant(vendor=vendor, work_order=work_order, requested_by=actor, starts=starts, expires=expires)
    with transaction.atomic():
        grant.save()
        audit.record("vendor.grant.request", actor=actor, target=grant,
                     target_label=f"{vendor.get_username()} on WO-{work_order.pk}",
                     after={"vendor": vendor.get_username(), "work_order": work_order.pk,
                            "starts": starts, "expires": expires})
    return grant


def approve_vendor_grant(actor, grant: VendorGrant) -> VendorGrant:
    """A security admin other than the requester approves; needs a recent re-authentication."""
    label = f"{grant.vendor.get_username()} on WO-{grant.work_order_id}"
    if not access.has_platform_perm(actor, "approve_vendor_grants"):
        deny(actor, "vendor.grant.approve", "only security admins approve vendor access", target=grant,
             target_label=label)
    if grant.requested_by_id == actor.pk:
        deny(actor, "vendor.grant.approve", "the requester cannot approve their own request", target=grant,
             target_label=label)
    if grant.approved_by_id is not None:
        raise ValidationError({"grant": "this grant is already approved"})
    if grant.revoked is not None:
        raise ValidationError({"grant": "this grant was revoked"})
    if grant.expires <= timezone.now():
        raise ValidationError({"grant": "this grant has already expired"})
    require_sudo(actor, "vendor.grant.approve", target=grant, target_label=label)
    with transaction.atomic():
        audit.lock_chain()  # before any row lock: the order every audited writer uses
        grant = VendorGrant.objects.select_for_update().get(pk=grant.pk)
        if grant.approved_by_id is not None or grant.revoked is not None:
            raise ValidationError({"grant": "this grant changed meanwhile; reload"})
        grant.approved_by = actor
        grant.save(update_fields=["approved_by"])
        audit.record("vendor.grant.approve", actor=actor, target=grant, target_label=label,
                     after={"vendor": grant.vendor.get_username(), "work_order": grant.work_order_id,
                            "starts": grant.starts, "expires": grant.expires})
    return grant


def revoke_vendor_grant(actor, grant: VendorGrant, *, reason: str = "") -> VendorGrant:
    """Ops or security end a grant; the vendor's open sessions end at their next request."""
    label = f"{grant.vendor.get_username()} on WO-{grant.work_order_id}"
    if not (access.has_platform_perm(actor, "approve_vendor_grants")
            or access.has_platform_perm(actor, "operate_inventory")):
        deny(actor, "vendor.grant.revoke", "only ops or security revoke vendor access", target=grant,
             target_label=label)
    if grant.revoked is not None:
        raise ValidationError({"grant": "this grant is already revoked"})
    with transaction.atomic():
        audit.lock_chain()  # before any row lock: the order every audited writer uses
        grant = VendorGrant.objects.select_for_update().get(pk=grant.pk)
        grant.revoked = timezone.now()
        grant.save(update_fields=["revoked"])
        audit.record("vendor.grant.revoke", actor=actor, target=grant, target_label=label, reason=reason,
                     before={"approved_by": grant.approved_by_id}, after={"revoked": grant.revoked})
    return grant
