"""Read-only questions the binding history answers, both ways, now or at a past instant.

"What was on card X at time T, and whose was it?" (`occupants`) and "which cards did job Y
use, and when?" (`cards_of`), plus the helpers health and node-failure handling use to find
the jobs on a set of cards. A binding holds its card over the half-open interval
[start, end): at the instant a binding ends the card already belongs to the next holder.
Everything here returns querysets the caller still has to restrict to what the viewer may see
(tenants.access); nothing here changes a row.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from decimal import Decimal

from django.db.models import Q, QuerySet

from scheduling.models import ACTIVE_STATES, Accelerator, Binding, Job, Node, Quota, QuotaResource


def _at(qs: QuerySet, at: dt.datetime | None) -> QuerySet:
    if at is None:
        return qs.filter(end__isnull=True)
    return qs.filter(start__lte=at).filter(Q(end__isnull=True) | Q(end__gt=at))


def occupants(card: Accelerator | int, at: dt.datetime | None = None) -> QuerySet:
    """Bindings holding `card` at `at` (now if None), with their job, project and tenant."""
    card_id = getattr(card, "pk", card)
    return _at(Binding.objects.filter(accelerator_id=card_id), at).select_related(
        "job", "project", "tenant"
    ).order_by("start", "id")


def cards_of(job: Job | int, at: dt.datetime | None = None) -> QuerySet:
    """The job's bindings: every one it ever had (at None), or those holding a card at `at`."""
    job_id = getattr(job, "pk", job)
    qs = Binding.objects.filter(job_id=job_id)
    if at is not None:
        qs = _at(qs, at)
    return qs.select_related("accelerator__node", "accelerator__model").order_by("start", "replica", "id")


def jobs_on_cards(card_ids, at: dt.datetime | None = None) -> QuerySet:
    """Jobs holding any of these cards at `at` (now if None), each once."""
    held = _at(Binding.objects.filter(accelerator_id__in=list(card_ids)), at).values("job_id")
    return Job.objects.filter(pk__in=held)


def affected_by_node(node: Node, at: dt.datetime | None = None) -> dict:
    """Jobs and tenants a node's failure touches, from the bindings on its cards."""
    jobs = list(jobs_on_cards(Accelerator.objects.filter(node=node).values_list("pk", flat=True), at)
                .select_related("tenant", "project"))
    return {"jobs": jobs, "tenants": sorted({j.tenant for j in jobs}, key=lambda t: t.slug)}


def _num(x: Decimal) -> str:
    return f"{x:.0f}" if x == x.to_integral_value() else f"{x:.3f}".rstrip("0")


def quota_preview(project, spec, replicas: int = 1) -> list[dict]:
    """For the submit page: each GPU quota line of the project and its tenant that the spec
    counts against, with what is in use, what the job would add and what would be left.

    The job's model is not known before placement, so a spec with several compatible models
    shows one row per model (the job uses exactly one of them).
    """
    if project is None or spec is None:
        return []
    replicas = max(int(replicas or 1), 1)
    models = list(spec.accelerator_models.all())
    need = Decimal(str(round(spec.card_fraction * replicas, 3)))
    lines = list(Quota.objects.filter(
        Q(project=project) | Q(tenant_id=project.tenant_id, project__isnull=True),
        resource=QuotaResource.GPUS, accelerator_model__in=models,
    ).select_related("accelerator_model", "tenant", "project"))
    if not lines:
        return []
    used_project: dict[int, Decimal] = defaultdict(Decimal)
    used_tenant: dict[int, Decimal] = defaultdict(Decimal)
    rows = (Binding.objects.filter(end__isnull=True, tenant_id=project.tenant_id, job__state__in=ACTIVE_STATES,
                                   accelerator__model__in=models)
            .values_list("project_id", "accelerator__model_id", "share_milli", "mig_profile"))
    for project_id, model_id, share, mig_profile in rows:
        if mig_profile:
            slices = int(mig_profile.split("g.", 1)[0]) if "g." in mig_profile else 7
            amount = Decimal(slices) / 7
        else:
            amount = Decimal(share) / 1000
        used_tenant[model_id] += amount
        if project_id == project.pk:
            used_project[model_id] += amount
    out = []
    for q in sorted(lines, key=lambda q: (q.project_id is None, q.accelerator_model.name)):
        used = (used_project if q.project_id else used_tenant)[q.accelerator_model_id]
        used = used.quantize(Decimal("0.001"))
        left = q.limit - used - need
        out.append({
            "owner": f"project {project.slug}" if q.project_id else f"tenant {q.tenant.slug}",
            "model": q.accelerator_model.short_name,
            "used": _num(used), "need": _num(need), "limit": _num(q.limit),
            "guaranteed": _num(q.guaranteed), "left": _num(left), "fits": left >= 0,
            "borrows": used + need > q.guaranteed,
        })
    return out
