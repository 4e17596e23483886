"""What the home page shows each user: a summary of exactly what their roles reach.

Built from visible_to() querysets only, so a user never sees a number that includes another
tenant's rows unless a platform role allows the aggregate.
"""

from __future__ import annotations

from django.db.models import Count, Q

from tenants import access


def home_context(user) -> dict:
    from scheduling.models import ACTIVE_STATES, Job, JobState, Node
    from tenants.models import Project, Tenant

    perms = access.platform_perms(user)
    ctx: dict = {"platform_roles": sorted(user.platform_roles.values_list("role", flat=True))}
    ctx["tenants"] = list(access.visible_to(user, Tenant).annotate(project_count=Count("projects")))
    projects = access.visible_to(user, Project).select_related("tenant")
    job_counts = {
        row["project"]: row
        for row in Job.objects.filter(project__in=projects).values("project").annotate(
            running=Count("id", filter=Q(state__in=ACTIVE_STATES)),
            pending=Count("id", filter=Q(state__in=[JobState.PENDING, JobState.PREEMPTED])),
        )
    }
    ctx["projects"] = [
        {"project": p, "running": job_counts.get(p.pk, {}).get("running", 0),
         "pending": job_counts.get(p.pk, {}).get("pending", 0)}
        for p in projects
    ]
    ctx["recent_jobs"] = list(
        access.visible_to(user, Job).select_related("project__tenant", "spec").order_by("-submitted")[:10]
    )
    if "view_inventory" in perms:
        ctx["inventory"] = Node.objects.aggregate(
            nodes=Count("id", distinct=True),
            cards=Count("accelerators", distinct=True),
            unhealthy=Count("accelerators", filter=~Q(accelerators__health="healthy"), distinct=True),
        )
    nodes, cards, _ = access.vendor_scope(user)
    if access.is_vendor_only(user):
        ctx["vendor_nodes"] = list(access.visible_to(user, Node).prefetch_related("accelerators"))
    return ctx
