"""Domain operations of the scheduler: inventory, specs, priority classes, quotas, jobs, health.

The only place that changes scheduling rows. Each function takes the acting user (or a
service identity through portal.context), checks permission through tenants.access, changes
state in one transaction and writes exactly one audit event. Submission stores a PENDING job
and enqueues a cycle after commit; it never admits a job itself.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count, Q, Sum
from django.utils import timezone

from portal import audit
from portal.services import deny, require_sudo
from scheduling.models import (
    ACTIVE_STATES,
    Accelerator,
    AcceleratorModel,
    Binding,
    BindingEnd,
    Health,
    HealthEvent,
    HealthEventKind,
    Job,
    JobEvent,
    JobState,
    Node,
    NodeState,
    PriorityClass,
    Quota,
    QuotaResource,
    ResourcePool,
    ResourceSpec,
    ShareMode,
    WaitReason,
)
from tenants import access
from tenants.models import Project, ProjectMembership, Tenant, TenantMembership

# --- inventory --------------------------------------------------------------------------


def _require_platform(actor, perm: str, action: str, **target) -> None:
    if not access.has_platform_perm(actor, perm):
        deny(actor, action, f"needs the platform permission {perm}", **target)


def create_accelerator_model(actor, **fields) -> AcceleratorModel:
    _require_platform(actor, "manage_policy", "inventory.model.create", target_label=fields.get("name", ""))
    model = AcceleratorModel(**fields)
    model.full_clean()
    with transaction.atomic():
        model.save()
        audit.record("inventory.model.create", actor=actor, target=model, after=fields)
    return model


def create_pool(actor, **fields) -> ResourcePool:
    _require_platform(actor, "manage_policy", "inventory.pool.create", target_label=fields.get("name", ""))
    pool = ResourcePool(**fields)
    pool.full_clean()
    with transaction.atomic():
        pool.save()
        audit.record("inventory.pool.create", actor=actor, target=pool, after=fields)
    return pool


def register_node(
    actor, *, pool: ResourcePool, name: str, cpu_milli: int, memory_mib: int, model: AcceleratorModel,
    cards: int, nvlink_domains: int = 1, labels: dict | None = None, uuid_prefix: str = "GPU",
) -> Node:
    """Add a node with `cards` identical cards split evenly over `nvlink_domains`."""
    _require_platform(actor, "operate_inventory", "inventory.node.register", target_label=name)
    if cards < 1 or nvlink_domains < 1 or cards % nvlink_domains:
        raise ValidationError({"cards": "cards must split evenly over the NVLink domains"})
    node = Node(pool=pool, name=name, cpu_milli=cpu_milli, memory_mib=memory_mib, labels=labels or {})
    node.full_clean()
    per_domain = cards // nvlink_domains
    with transaction.atomic():
        node.save()
        Accelerator.objects.bulk_create(
            Accelerator(
                node=node, index=i, uuid=f"{uuid_prefix}-{name}-{i}", model=model,
                nvlink_domain=i // per_domain, mig_enabled=pool.mig_enabled,
            )
            for i in range(cards)
        )
        audit.record("inventory.node.register", actor=actor, target=node,
                     after={"pool": pool.name, "cards": cards, "model": model.name})
    return node


# --- specs and priority classes -----------------------------------------------------------


def spec_satisfiable(spec: ResourceSpec, models: list[AcceleratorModel], pools: list[ResourcePool]) -> str:
    """Why no pool could ever run this spec, or "" if some node could (ignoring health)."""
    nodes = Node.objects.filter(retired__isnull=True)
    if pools:
        nodes = nodes.filter(pool__in=pools)
    if spec.mode == ShareMode.FRACTION:
        nodes = nodes.filter(pool__allows_sharing=True)
    if spec.mode == ShareMode.MIG:
        nodes = nodes.filter(pool__mig_enabled=True)
    else:
        nodes = nodes.filter(pool__mig_enabled=False)
    nodes = nodes.filter(cpu_milli__gte=spec.cpu_milli, memory_mib__gte=spec.memory_mib)
    for node in nodes.prefetch_related("accelerators"):
        per_domain: dict[int, int] = {}
        for card in node.accelerators.all():
            if card.retired is None and card.model in models:
                if spec.mode == ShareMode.MIG and spec.mig_profile not in card.model.mig_profiles:
                    continue
                per_domain[card.nvlink_domain] = per_domain.get(card.nvlink_domain, 0) + 1
        needed = spec.gpu_count if spec.mode == ShareMode.WHOLE else 1
        if per_domain and max(per_domain.values()) >= needed:
            return ""
    what = f"{spec.gpu_count} x {'/'.join(m.short_name for m in models)}"
    if spec.mode != ShareMode.WHOLE:
        what = f"{spec.get_mode_display()} of {'/'.join(m.short_name for m in models)}"
    return f"no pool has a node with {what} in one NVLink domain and {spec.cpu_milli // 1000} CPU / {spec.memory_mib // 1024} GiB"


def create_spec(actor, *, models: list[AcceleratorModel], pools: list[ResourcePool] | None = None, **fields) -> ResourceSpec:
    _require_platform(actor, "manage_policy", "spec.create", target_label=fields.get("name", ""))
    spec = ResourceSpec(**fields)
    spec.full_clean()
    if not models:
        raise ValidationError({"accelerator_models": "choose at least one compatible accelerator model"})
    if spec.mode == ShareMode.MIG:
        if not spec.mig_profile:
            raise ValidationError({"mig_profile": "a MIG spec names its profile, e.g. 3g.40gb"})
        if spec.gpu_count != 1:
            raise ValidationError({"gpu_count": "a MIG spec asks for one slice"})
    if spec.mode == ShareMode.FRACTION and not (0 < spec.fraction_milli < 1000 and spec.gpu_count == 1):
        raise ValidationError({"fraction_milli": "a share is between 1 and 999 thousandths of one card"})
    why = spec_satisfiable(spec, models, pools or [])
    if why:
        raise ValidationError({"__all__": f"This spec could never run: {why}."})
    with transaction.atomic():
        spec.save()
        spec.accelerator_models.set(models)
        spec.pools.set(pools or [])
        audit.record("spec.create", actor=actor, target=spec,
                     after={**fields, "models": [m.name for m in models]})
    return spec


def save_priority_class(actor, **fields) -> PriorityClass:
    _require_platform(actor, "manage_policy", "priority.change", target_label=fields.get("name", ""))
    require_sudo(actor, "priority.change", target_label=fields.get("name", ""))
    existing = PriorityClass.objects.filter(name=fields["name"]).first()
    before = None
    if existing:
        before = {k: getattr(existing, k) for k in fields}
        for k, v in fields.items():
            setattr(existing, k, v)
        pc = existing
    else:
        pc = PriorityClass(**fields)
    pc.full_clean()
    with transaction.atomic():
        pc.save()
        audit.record("priority.change", actor=actor, target=pc, before=before, after=fields)
    return pc


# --- quotas ---------------------------------------------------------------------------


def _quota_filter(resource: str, model: AcceleratorModel | None) -> Q:
    return Q(resource=resource, accelerator_model=model)


def set_quota(
    actor, *, tenant: Tenant, project: Project | None = None, resource: str,
    accelerator_model: AcceleratorModel | None = None, guaranteed, limit,
) -> Quota:
    """Set one quota line. Tenant lines: platform admins with sudo. Project lines: the
    tenant's admins, inside what the tenant line allows."""
    guaranteed, limit = Decimal(str(guaranteed)), Decimal(str(limit))
    action = "quota.change"
    if resource not in QuotaResource.values:
        raise ValidationError({"resource": f"unknown quota resource {resource!r}"})
    if (resource == QuotaResource.GPUS) != (accelerator_model is not None):
        raise ValidationError({"accelerator_model": "GPU lines name an accelerator model; other lines do not"})
    if guaranteed < 0 or limit < guaranteed:
        raise ValidationError({"limit": "the limit must be at least the guaranteed amount, both non-negative"})
    if project is not None and project.tenant_id != tenant.pk:
        raise ValidationError({"project": "the project belongs to another tenant"})
    existing = Quota.objects.filter(tenant=tenant, project=project).filter(
        _quota_filter(resource, accelerator_model)
    ).first()
    before = {"guaranteed": existing.guaranteed, "limit": existing.limit} if existing else None
    if project is None:
        if not access.has_platform_perm(actor, "manage_tenants"):
            deny(actor, action, "only platform admins change a tenant's quota", target=tenant, tenant=tenant)
        raising = existing is None or limit > existing.limit or guaranteed > existing.guaranteed
        if raising:
            require_sudo(actor, action, target=tenant, tenant=tenant)
    else:
        if not (access.has_platform_perm(actor, "manage_tenants") or access.can(actor, "split_tenant_quota", tenant)):
            deny(actor, action, "only the tenant's admins split its quota", target=project, project=project)
        line = Quota.objects.filter(tenant=tenant, project=None).filter(_quota_filter(resource, accelerator_model)).first()
        if line is None:
            raise ValidationError({"limit": "the tenant has no quota for this resource to split"})
        others = Quota.objects.filter(tenant=tenant, project__isnull=False).filter(
            _quota_filter(resource, accelerator_model)
        ).exclude(project=project).aggregate(g=Sum("guaranteed"))["g"] or Decimal(0)
        if limit > line.limit:
            raise ValidationError({"limit": f"the tenant's limit is {line.limit.normalize():f}; a project cannot exceed it"})
        if others + guaranteed > line.guaranteed:
            left = line.guaranteed - others
            raise ValidationError({"guaranteed": (
                f"only {left.normalize():f} of the tenant's guaranteed {line.guaranteed.normalize():f} is left to split"
            )})
    with transaction.atomic():
        quota, _ = Quota.objects.update_or_create(
            tenant=tenant, project=project, resource=resource, accelerator_model=accelerator_model,
            defaults={"guaranteed": guaranteed, "limit": limit},
        )
        audit.record(action, actor=actor, target=quota, tenant=tenant, project=project,
                     target_label=str(quota), before=before, after={"guaranteed": guaranteed, "limit": limit})
    return quota


# --- jobs -----------------------------------------------------------------------------


def allowed_priority_classes(user, project: Project):
    """Priority classes this user may use in this project (class of project and role)."""
    roles = set(ProjectMembership.objects.filter(user=user, project=project).values_list("role", flat=True))
    roles |= set(TenantMembership.objects.filter(user=user, tenant_id=project.tenant_id).values_list("role", flat=True))
    out = []
    for pc in PriorityClass.objects.all():
        if pc.allowed_project_classes and project.project_class not in pc.allowed_project_classes:
            continue
        if pc.allowed_roles and not roles & set(pc.allowed_roles):
            continue
        out.append(pc)
    return out


def submit_job(
    actor, *, project: Project, spec: ResourceSpec, priority_class: PriorityClass, name: str,
    image: str, command: list[str], replicas: int = 1, time_limit_minutes: int = 1440,
    expected_minutes: int = 60, submitted: dt.datetime | None = None, kind: str = "batch",
) -> Job:
    if not access.can(actor, "submit_job", project):
        if project.pk in access.project_ids(actor, "view_project"):
            deny(actor, "job.submit", "you may not submit jobs in this project", target=project, project=project)
        deny(actor, "job.submit", "project not in reach", target_label=str(project.pk))
    if not project.is_active:
        raise ValidationError({"project": "this project is archived or its tenant suspended"})
    if not spec.active:
        raise ValidationError({"spec": "this resource spec is retired"})
    if priority_class not in allowed_priority_classes(actor, project):
        deny(actor, "job.submit",
             f"priority class {priority_class.name} is not allowed for {project.get_project_class_display()} "
             "projects or your role", target=project, project=project)
    job = Job(
        tenant=project.tenant, project=project, submitter=actor, name=name, spec=spec,
        priority_class=priority_class, replicas=replicas, image=image, command=command,
        time_limit_minutes=time_limit_minutes, expected_minutes=expected_minutes,
        submitted=submitted or timezone.now(), kind=kind, wait_reason=WaitReason.QUEUED,
        wait_message="Waiting for the next scheduling cycle.",
    )
    job.full_clean()
    with transaction.atomic():
        job.save()
        JobEvent.objects.create(job=job, time=job.submitted, kind="submitted",
                                message=f"Submitted by {actor.get_username()} with {spec.name}, {priority_class.name}.")
        audit.record("job.submit", actor=actor, target=job, project=project,
                     after={"spec": spec.name, "priority": priority_class.name, "replicas": replicas, "image": image})
        transaction.on_commit(_enqueue_cycle)
    return job


def _enqueue_cycle() -> None:
    from scheduling import jobs

    jobs.enqueue_cycle()


def enqueue_cycle_after_commit() -> None:
    transaction.on_commit(_enqueue_cycle)


def cancel_job(actor, job: Job, *, reason: str = "") -> Job:
    own = job.submitter_id == actor.pk and access.can(actor, "submit_job", job.project)
    if not (own or access.can(actor, "cancel_project_jobs", job.project) or access.has_platform_perm(actor, "manage_tenants")):
        deny(actor, "job.cancel", "you may cancel only your own jobs here", target=job, project=job.project)
    if job.is_final:
        raise ValidationError({"state": f"job {job.pk} is already {job.state}"})
    now = timezone.now()
    with transaction.atomic():
        audit.lock_chain()  # before the job's row lock: the cycle takes them in this order
        job = Job.objects.select_for_update(no_key=True).get(pk=job.pk)
        if job.is_final:
            raise ValidationError({"state": f"job {job.pk} is already {job.state}"})
        before = job.state
        Binding.objects.filter(job=job, end__isnull=True).update(end=now, end_reason=BindingEnd.CANCELLED)
        job.state = JobState.CANCELLED
        job.finished = now
        job.wait_reason = WaitReason.NONE
        job.wait_message = ""
        job.queue_position = None
        job.save()
        JobEvent.objects.create(job=job, time=now, kind="cancelled",
                                message=f"Cancelled by {actor.get_username()}" + (f": {reason}" if reason else "."))
        audit.record("job.cancel", actor=actor, target=job, project=job.project,
                     before={"state": before}, after={"state": job.state}, reason=reason)
        transaction.on_commit(_enqueue_cycle)
    return job


# --- health -----------------------------------------------------------------------------

# XIDs that mean the card cannot be trusted (NVIDIA's "reset/replace" class), and what to do.
FATAL_XIDS = {48, 63, 64, 74, 79, 92, 94, 95, 119, 120}
DEGRADING_XIDS = {13, 31, 43, 45, 61, 62, 69}


def health_policy(kind: str, code: int | None) -> str:
    """The health a card gets after an event: the policy the simulated and real backends share."""
    if kind in (HealthEventKind.ECC_DBE, HealthEventKind.ROW_REMAP, HealthEventKind.MISSING):
        return Health.FAILED if kind == HealthEventKind.MISSING else Health.QUARANTINED
    if kind == HealthEventKind.XID:
        if code == 79:  # fallen off the bus: keep it out until someone looks
            return Health.DEGRADED
        if code in FATAL_XIDS:
            return Health.QUARANTINED
        if code in DEGRADING_XIDS:
            return Health.DEGRADED
        return Health.HEALTHY
    if kind == HealthEventKind.THERMAL:
        return Health.DEGRADED
    return Health.HEALTHY


def record_health_event(actor, card: Accelerator, *, kind: str, code: int | None = None, message: str,
                        time: dt.datetime | None = None) -> HealthEvent:
    """A health signal from a backend (or ops): apply the policy, requeue jobs on a failed card."""
    if actor is not None and not access.has_platform_perm(actor, "operate_inventory"):
        deny(actor, "card.health", "only ops engineers report health", target=card)
    now = time or timezone.now()
    new_health = health_policy(kind, code)
    severity = [Health.HEALTHY, Health.DEGRADED, Health.QUARANTINED, Health.FAILED]
    with transaction.atomic():
        audit.lock_chain()  # before any row lock: the order every audited writer uses
        card = Accelerator.objects.select_for_update(of=("self",), no_key=True).select_related("node").get(pk=card.pk)
        before = card.health
        # an event never makes a card healthier: only ops release a card (set_card_health)
        resulting = max(before, new_health, key=severity.index)
        event = HealthEvent.objects.create(
            accelerator=card, time=now, kind=kind, code=code, message=message, resulting_health=resulting
        )
        if resulting != before:
            card.health = resulting
            card.health_reason = message
            card.health_since = now
            card.save(update_fields=["health", "health_reason", "health_since"])
            if resulting in (Health.QUARANTINED, Health.FAILED):
                _requeue_jobs_on_card(card, now, reason=f"card {card} {resulting}: {message}")
            audit.record("card.quarantine" if resulting != Health.HEALTHY else "card.health", actor=actor,
                         actor_label="" if actor else "service:health", target=card,
                         before={"health": before}, after={"health": resulting, "event": message})
    return event


def _requeue_jobs_on_card(card: Accelerator, now, *, reason: str,
                          end_reason: str = BindingEnd.CARD_FAILED) -> list[Job]:
    """Requeue every job holding the card (found from its open bindings) and alarm its tenant.

    All of a job's bindings end (a multi-card or multi-node job cannot run on part of its
    cards). The alarm is a job event of kind "alarm", an audit event the tenant's admins see
    in their audit log and a metering Alarm on the project's dashboard.
    """
    from scheduling.queries import jobs_on_cards

    jobs = list(jobs_on_cards([card.pk]).select_for_update(of=("self",), no_key=True).select_related("project__tenant"))
    for job in jobs:
        _requeue_job(job, now, reason=reason, end_reason=end_reason)
    if jobs:
        transaction.on_commit(_enqueue_cycle)
    return jobs


def _requeue_job(job: Job, now, *, reason: str, end_reason: str, wait_reason: str = WaitReason.HEALTH,
                 alarm: bool = True) -> bool:
    """Put one active job (row locked by the caller) back in the queue, ending all its bindings.

    With `alarm` the owner is told here (job event, audit event, project Alarm); callers that
    raise their own alarm and write their own audit event (interference) pass alarm=False.
    """
    if job.state not in ACTIVE_STATES:
        return False
    Binding.objects.filter(job=job, end__isnull=True).update(end=now, end_reason=end_reason)
    before = job.state
    job.state = JobState.PENDING
    job.started = None
    job.admitted = None
    job.wait_reason = wait_reason
    job.wait_message = f"Requeued: {reason}."[:400]
    job.queue_position = None
    job.save()
    JobEvent.objects.create(job=job, time=now, kind="requeued", message=f"Requeued because {reason}."[:400])
    if not alarm:
        return True
    JobEvent.objects.create(job=job, time=now, kind="alarm",
                            message=f"Alarm: job {job.pk} lost its cards ({reason}) and waits to be rescheduled."[:400])
    audit.record("alarm.job_requeued", target=job, project=job.project, reason=reason,
                 before={"state": before}, after={"state": job.state, "end_reason": end_reason})
    from metering.services import raise_alarm

    raise_alarm(
        kind="job_requeued", severity="critical", project=job.project,
        message=f"Job {job.pk} ({job.name}) lost its cards: {reason}.",
        action="Nothing to do: it waits to be rescheduled on healthy cards. Ops have been told.",
        dedupe_key=f"job:{job.pk}:requeued:{now.isoformat()}",
    )
    return True


def set_card_health(actor, card: Accelerator, health: str, *, reason: str) -> Accelerator:
    """Ops quarantines or releases a card by hand (audited)."""
    _require_platform(actor, "operate_inventory", "card.quarantine" if health != Health.HEALTHY else "card.release",
                      target=card)
    if health not in Health.values:
        raise ValidationError({"health": f"unknown health {health!r}"})
    if not reason.strip():
        raise ValidationError({"reason": "say why, for the card's history"})
    now = timezone.now()
    action = "card.release" if health == Health.HEALTHY else "card.quarantine"
    with transaction.atomic():
        audit.lock_chain()  # before any row lock: the order every audited writer uses
        card = Accelerator.objects.select_for_update(no_key=True).get(pk=card.pk)
        before = card.health
        card.health, card.health_reason, card.health_since = health, reason, now
        card.save(update_fields=["health", "health_reason", "health_since"])
        HealthEvent.objects.create(accelerator=card, time=now, kind=HealthEventKind.MANUAL,
                                   message=f"{actor.get_username()}: {reason}", resulting_health=health)
        if health in (Health.QUARANTINED, Health.FAILED):
            _requeue_jobs_on_card(card, now, reason=f"card {card} {health} by ops: {reason}")
        audit.record(action, actor=actor, target=card, before={"health": before}, after={"health": health},
                     reason=reason)
        if health == Health.HEALTHY:
            transaction.on_commit(_enqueue_cycle)
    return card


def set_node_state(actor, node: Node, state: str, *, reason: str) -> Node:
    _require_platform(actor, "operate_inventory", "node.state", target=node)
    if state not in NodeState.values:
        raise ValidationError({"state": f"unknown node state {state!r}"})
    now = timezone.now()
    with transaction.atomic():
        audit.lock_chain()  # before any row lock: the order every audited writer uses
        node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
        before = node.state
        node.state, node.state_reason, node.state_since = state, reason, now
        node.save(update_fields=["state", "state_reason", "state_since"])
        if state == NodeState.DOWN:
            for card in node.accelerators.select_related("node"):
                _requeue_jobs_on_card(card, now, reason=f"node {node} down: {reason}", end_reason=BindingEnd.NODE_DOWN)
        audit.record("node.state", actor=actor, target=node, before={"state": before}, after={"state": state},
                     reason=reason)
        transaction.on_commit(_enqueue_cycle)
    return node


# --- interference on shared cards ----------------------------------------------------------


def open_shared_bindings():
    """Open bindings that share a card by fraction (whole cards and MIG slices cannot interfere)."""
    return Binding.objects.filter(end__isnull=True, share_milli__lt=1000, mig_profile="")


def record_utilisation(readings, *, now: dt.datetime, replace: bool = False) -> int:
    """Store what each share used at `now`: `readings` are (binding or binding id, used thousandths
    of the whole card). A backend calls this on each tick; a reading taken twice at the same
    instant is stored once (the first one, or the new one with `replace`). Samples older than
    twice the interference window (at least an hour) are pruned: they are telemetry for the
    interference check, not history."""
    from scheduling.models import UtilisationSample

    rows = [
        UtilisationSample(binding_id=getattr(b, "pk", b), time=now, used_milli=max(0, min(1000, int(used))))
        for b, used in readings
    ]
    keep = max(2 * dt.timedelta(minutes=settings.ATRIUM_INTERFERENCE_WINDOW_MINUTES), dt.timedelta(hours=1))
    with transaction.atomic():
        if replace:
            UtilisationSample.objects.bulk_create(rows, update_conflicts=True, unique_fields=["binding", "time"],
                                                  update_fields=["used_milli"])
        else:
            UtilisationSample.objects.bulk_create(rows, ignore_conflicts=True)
        UtilisationSample.objects.filter(time__lt=now - keep).delete()
    return len(rows)


def interference_policy():
    from scheduling.interference import Policy

    return Policy(factor=float(settings.ATRIUM_INTERFERENCE_FACTOR),
                  window=dt.timedelta(minutes=settings.ATRIUM_INTERFERENCE_WINDOW_MINUTES))


def check_interference(now: dt.datetime | None = None, *, policy=None) -> list[dict]:
    """Find the shares that persistently took far more than they asked for (scheduling.interference)
    and handle each (alarms, audit, the configured policy). Returns what was handled this time;
    an offence already handled in the same hour is not handled again."""
    from scheduling.interference import Sample, Share, find_offenders
    from scheduling.models import UtilisationSample

    now = now or timezone.now()
    policy = policy or interference_policy()
    # only cards shared right now can have a victim; their bindings of the last two windows give
    # both the offender's run and who else held the card at each sample
    cards = list(open_shared_bindings().values("accelerator_id").annotate(n=Count("id")).filter(n__gte=2)
                 .values_list("accelerator_id", flat=True))
    if not cards:
        return []
    since = now - 2 * policy.window
    bindings = list(Binding.objects.filter(accelerator_id__in=cards, share_milli__lt=1000, mig_profile="")
                    .filter(Q(end__isnull=True) | Q(end__gt=since)).filter(start__lte=now))
    samples: dict[int, list] = {b.pk: [] for b in bindings}
    for binding_id, time, used in (UtilisationSample.objects.filter(binding_id__in=samples, time__gte=since, time__lte=now)
                                   .values_list("binding_id", "time", "used_milli")):
        samples[binding_id].append(Sample(time, used))
    shares = [Share(b.pk, b.job_id, b.accelerator_id, b.share_milli, b.start, b.end, tuple(samples[b.pk]))
              for b in bindings]
    handled = []
    for offender in find_offenders(shares, now=now, policy=policy):
        result = handle_interference(offender, now=now)
        if result:
            handled.append(result)
    return handled


def _pct(milli: int | float) -> str:
    return f"{milli / 10:.0f}%"


def handle_interference(offender, *, now: dt.datetime | None = None, policy: str | None = None) -> dict | None:
    """Act on one offender found by scheduling.interference: one ops alarm (tenant None), one
    alarm per project owning a job on the card, one health event in the card's history, one
    audit event; then the policy (ATRIUM_INTERFERENCE_POLICY): "warn" leaves the job running,
    "requeue" ends its bindings and puts it back in the queue (the jobs it slowed keep running).

    Deduplicated per card, offender and hour: called again on every tick while the offence
    lasts, it does nothing until the next hour. Victims' alarms never name the offending job or
    its tenant; only ops see who it was.
    """
    from metering.models import Alarm
    from metering.services import raise_alarm

    now = now or timezone.now()
    policy = policy or settings.ATRIUM_INTERFERENCE_POLICY
    if policy not in ("warn", "requeue"):
        raise ValidationError({"policy": f"unknown interference policy {policy!r}: choose warn or requeue"})
    key = f"interference:card:{offender.card_id}:job:{offender.job_id}:{now.astimezone(dt.UTC):%Y-%m-%dT%H}"
    with transaction.atomic():
        audit.lock_chain()  # before any row lock: the order every audited writer uses
        # one handler per card at a time, so two ticks racing raise and audit it once
        card = Accelerator.objects.select_for_update(of=("self",), no_key=True).select_related("node").get(pk=offender.card_id)
        if Alarm.objects.filter(dedupe_key=f"{key}:ops").exists():
            return None
        job = (Job.objects.select_for_update(of=("self",), no_key=True).select_related("project__tenant")
               .filter(pk=offender.job_id).first())
        if job is None or job.state not in ACTIVE_STATES or not Binding.objects.filter(
                pk=offender.binding_id, end__isnull=True).exists():
            return None
        sharing = list(Binding.objects.filter(accelerator=card, end__isnull=True)
                       .select_related("job", "project__tenant").order_by("start", "id"))
        minutes = max(1, round((now - offender.since).total_seconds() / 60))
        what = (f"used {_pct(offender.used_milli)} of card {card} on average for {minutes} min against its "
                f"{_pct(offender.share_milli)} share (allowed up to {_pct(offender.threshold_milli)})")
        others = [b for b in sharing if b.job_id != job.pk]
        requeue = policy == "requeue"
        ops_action = ("It was requeued; it may be placed again (on any shared card) by the next cycle."
                      if requeue else
                      "Policy is warn: it keeps running. Ask its owners to cap its GPU use, or requeue it by hand.")
        raise_alarm(
            kind="interference", severity="warning", dedupe_key=f"{key}:ops",
            message=(f"Job {job.pk} ({job.project}/{job.name}) {what}, slowing "
                     + ", ".join(f"job {b.job_id} ({b.project})" for b in others) + "."),
            action=ops_action,
        )
        projects = {b.project_id: b.project for b in sharing}
        for project_id, project in sorted(projects.items()):
            own = [b.job_id for b in others if b.project_id == project_id]
            if project_id == job.project_id:
                message = f"Your job {job.pk} ({job.name}) {what}: it slows the other jobs sharing the card."
                action = ("It was requeued and waits for a card again. Keep its GPU use within its share, "
                          "or resubmit it with a whole-card spec." if requeue else
                          "Keep its GPU use within its share, or resubmit it with a whole-card spec; "
                          "ops have been told.")
            else:
                message = (f"Your job{'s' if len(own) > 1 else ''} {', '.join(map(str, own))} on card {card} "
                           f"may run slower: another job sharing the card used {_pct(offender.used_milli)} of it "
                           f"for {minutes} min against its {_pct(offender.share_milli)} share.")
                action = ("Nothing to do: the other job was requeued." if requeue else
                          "Nothing to do: ops and the other job's owners have been told.")
            raise_alarm(kind="interference", severity="warning", project=project,
                        dedupe_key=f"{key}:project:{project_id}", message=message, action=action)
        HealthEvent.objects.create(
            accelerator=card, time=now, kind=HealthEventKind.INTERFERENCE, resulting_health=card.health,
            message=f"job {job.pk} {what}"[:300],
        )
        reason = f"interference on shared card {card}: it {what}"
        before = job.state
        if requeue:
            _requeue_job(job, now, reason=reason, end_reason=BindingEnd.INTERFERENCE,
                         wait_reason=WaitReason.INTERFERENCE, alarm=False)
            transaction.on_commit(_enqueue_cycle)
        else:
            JobEvent.objects.create(job=job, time=now, kind="alarm",
                                    message=f"Alarm: {reason[0].upper()}{reason[1:]}."[:400])
        audit.record(
            "job.interference", target=job, project=job.project, actor_label="service:interference",
            reason=reason[:500],
            before={"state": before},
            after={"state": job.state, "policy": policy, "card": str(card), "share_milli": offender.share_milli,
                   "used_milli": offender.used_milli, "threshold_milli": offender.threshold_milli,
                   "minutes": minutes, "jobs_slowed": len(others)},
        )
    return {"job": job.pk, "card": card.pk, "policy": policy, "victims": [b.job_id for b in others],
            "projects": sorted(projects)}


def active_bindings_on(card: Accelerator, at: dt.datetime | None = None):
    """Who held this card at `at` (now if None): the bindings overlapping that instant."""
    from scheduling.queries import occupants

    return occupants(card, at)


def usage_now(project: Project) -> dict:
    """Active jobs of a project (for the submit page's quota preview)."""
    return {"jobs": Job.objects.filter(project=project, state__in=ACTIVE_STATES).count()}


def allowed_specs(project: Project | None):
    """Active specs the project can use: those with a card model its quota gives it (a GPU
    line with a positive limit on the project, or on its tenant when the project has none)."""
    specs = ResourceSpec.objects.filter(active=True)
    if project is None:
        return specs
    lines = Quota.objects.filter(tenant_id=project.tenant_id, resource=QuotaResource.GPUS)
    project_lines = lines.filter(project=project)
    lines = project_lines if project_lines.exists() else lines.filter(project__isnull=True)
    models = lines.filter(limit__gt=0).values("accelerator_model")
    return specs.filter(accelerator_models__in=models).distinct()


