"""Grow the demo organisation to the load benchmark's size (bench/load.py): the three demo
tenants plus `load-01`..`load-NN`, ten people in each tenant (a tenant admin, a finance viewer
who only reads, eight project users), quotas that admit some of the load's jobs and hold the
rest, and one published model service per tenant on the demo model server.

Run it after `seed_demo`, on the benchmark's own database. Idempotent per tenant: each tenant's
additions are made in one transaction and skipped when its admin account exists. Everything
goes through the services (role groups, audit), like seed_demo; only user accounts are written
directly. It adds people and, where none is published, a model service to the demo tenants,
and never changes a row seed_demo made.
"""

from __future__ import annotations

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from portal import context
from portal.management.commands.seed_demo import A100, DEMO_PASSWORD, DEMO_UPSTREAM, L4
from scheduling import services as sched
from scheduling.models import AcceleratorModel, PriorityClass, ResourceSpec
from serving import services as serving
from serving.models import ModelService, ServiceStatus
from tenants import services as tenancy
from tenants.models import Project, Tenant

DEMO_TENANTS = ("genomics", "nlp-group", "vision-lab")
USERS_PER_TENANT = 8  # plus the tenant admin and the finance viewer: ten people
SERVICE_SPEC = "l4 x0.25"  # a quarter L4 keeps 20 always-on services from filling the L4 pool
# per load tenant: (resource, model, guaranteed, limit); ~8 people submitting against 8 jobs
# and 2 cards per tenant means some jobs are admitted and others wait with a quota reason
TENANT_QUOTA = [("gpus", L4, 1, 2), ("gpus", A100, 1, 2), ("jobs", None, 4, 8), ("card_hours_month", None, 200, 400)]
PROJECTS = {  # slug: (class, quota lines (resource, model, guaranteed, limit))
    "train": ("research", [("gpus", L4, 0, 2), ("gpus", A100, 1, 2), ("jobs", None, 2, 6)]),
    "serve": ("production", [("gpus", L4, 1, 1), ("jobs", None, 2, 3)]),
}


def tenant_slugs(count: int) -> list[str]:
    """The load's tenants: the demo's three, then load-01, load-02, ..."""
    return [*DEMO_TENANTS, *(f"load-{i:02d}" for i in range(1, max(0, count - len(DEMO_TENANTS)) + 1))][:count]


def people_of(slug: str) -> list[tuple[str, str]]:
    """(username, kind) of the load's people in one tenant; kind is admin, finance or user."""
    return [(f"{slug}-admin", "admin"), (f"{slug}-finance", "finance"),
            *((f"{slug}-user-{i}", "user") for i in range(1, USERS_PER_TENANT + 1))]


class Command(BaseCommand):
    help = "Add the load benchmark's tenants, people, quotas and model services to the demo (idempotent)."

    def add_arguments(self, parser):
        parser.add_argument("--tenants", type=int, default=20, help="tenants in all, the three demo tenants included")

    def handle(self, *args, tenants: int, **opts):
        admin = get_user_model().objects.filter(username="platform-admin").first()
        if admin is None or not Tenant.objects.filter(slug__in=DEMO_TENANTS).exists():
            raise CommandError("the demo organisation is not here: run `manage.py seed_demo` first")
        made = 0
        with context.bound(actor_label="seed_load", sudo=True):
            for slug in tenant_slugs(tenants):
                if get_user_model().objects.filter(username=f"{slug}-admin").exists():
                    continue
                with transaction.atomic():
                    self._tenant(admin, slug)
                made += 1
        self.stdout.write(self.style.SUCCESS(f"seed_load: {made} tenants completed, {tenants} in the load."))

    def _tenant(self, admin, slug: str) -> None:
        models = {m.name: m for m in AcceleratorModel.objects.all()}
        tenant = Tenant.objects.filter(slug=slug).first()
        if tenant is None:  # a load tenant: the demo tenants keep their own projects and quotas
            tenant = tenancy.create_tenant(admin, slug=slug, name=f"Load tenant {slug[5:]}")
            for resource, model, guaranteed, limit in TENANT_QUOTA:
                sched.set_quota(admin, tenant=tenant, resource=resource, accelerator_model=models.get(model),
                                guaranteed=guaranteed, limit=limit)
            for p_slug, (p_class, lines) in PROJECTS.items():
                project = tenancy.create_project(admin, tenant, slug=p_slug, name=p_slug.title(), project_class=p_class,
                                                 cost_centre=f"CC-{slug[-2:]}{p_slug[0].upper()}")
                for resource, model, guaranteed, limit in lines:
                    sched.set_quota(admin, tenant=tenant, project=project, resource=resource,
                                    accelerator_model=models.get(model), guaranteed=guaranteed, limit=limit)
        projects = list(Project.objects.filter(tenant=tenant, archived__isnull=True).order_by("slug"))
        User = get_user_model()
        people = {}
        for username, _kind in people_of(slug):
            people[username] = User.objects.create_user(username, email=f"{username}@load.atrium.test",
                                                        password=DEMO_PASSWORD)
        tenancy.add_tenant_member(admin, tenant, people[f"{slug}-admin"], "tenant_admin")
        tenancy.add_tenant_member(admin, tenant, people[f"{slug}-finance"], "finance_viewer")
        users = [u for name, u in people.items() if name.startswith(f"{slug}-user-")]
        for i, user in enumerate(users):
            tenancy.add_project_member(admin, projects[i % len(projects)], user, "user")
        self._service(people[f"{slug}-admin"], tenant, projects)

    def _service(self, tenant_admin, tenant: Tenant, projects: list[Project]) -> None:
        """A published model service for the gateway calls, unless the tenant has one."""
        if ModelService.objects.filter(tenant=tenant, status=ServiceStatus.PUBLISHED).exists():
            return
        project = next((p for p in projects if p.project_class == "production"), projects[-1])
        classes = sched.allowed_priority_classes(tenant_admin, project)
        prio = max(classes, key=lambda c: (not c.preemptible, c.value)) if classes else PriorityClass.objects.first()
        service = serving.create_model_service(
            tenant_admin, project=project, slug="assistant", name="Assistant", base_model="Llama-3.1-8B-Instruct",
            spec=ResourceSpec.objects.get(name=SERVICE_SPEC), priority_class=prio, upstream_url=DEMO_UPSTREAM,
            visibility="tenant",
        )
        serving.publish_service(tenant_admin, service)
