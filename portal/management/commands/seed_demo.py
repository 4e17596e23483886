"""Load the demo organisation: a heterogeneous fleet, three tenants, their people and quotas,
and 30 days of history produced by running the real scheduler on a simulated clock.

Idempotent: the whole load runs in one transaction and is skipped when the demo is present,
so running it twice leaves the same rows. Everything goes through the services (audited and
metered like real use); nothing writes models directly except the user accounts.
"""

from __future__ import annotations

import datetime as dt
import random

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from django.db import transaction
from django.utils import timezone

from metering import services as metering
from portal import context
from scheduling import services as sched
from scheduling.backends.simulated import SimulatedCluster
from scheduling.cycle import run_cycle
from scheduling.models import Accelerator, HealthEventKind, Job, PriorityClass, ResourceSpec
from tenants import services as tenancy
from tenants.models import Project, Tenant, VendorGrant, WorkOrder

DEMO_PASSWORD = "atrium-demo"  # nosec B105 # the demo accounts' published password (README, make run)

ACCOUNTS = {
    "platform-admin": ("Platform admin", ["platform_admin"]),
    "ops": ("Ops engineer", ["ops_engineer"]),
    "security": ("Security admin", ["security_admin"]),
    "finance": ("Finance", ["finance"]),
    "auditor": ("Auditor", ["auditor"]),
    "vision-admin": ("Tenant admin of vision-lab", []),
    "vision-user": ("User of vision-lab/detector", []),
    "nlp-admin": ("Tenant admin of nlp-group", []),
    "nlp-user": ("User of nlp-group/llm-finetune and chat-prod", []),
    "genomics-user": ("User of genomics/folding", []),
    "vendor": ("Vendor with a valid work order on one H100 node", []),
    "vendor-expired": ("Vendor whose grant has ended", []),
}

H100, A100, L4, MI300 = "H100-SXM5-80GB", "A100-SXM4-80GB", "L4-24GB", "MI300X-192GB"
# `make run` starts a small OpenAI-compatible model server here (serving/upstream.py).
DEMO_UPSTREAM = "http://127.0.0.1:8001/v1"  # the demo model server answers under /v1

HANDBOOK = """# GPU etiquette in Vision Lab

Use the smallest spec that fits: an `l4 x0.5` share is enough for notebooks and labeling
tools. Book `h100-80g x4` or larger only for training runs, with the training priority class.
Checkpoint every 30 minutes: batch and training jobs can be preempted by production work.
"""

FAQ = """# Chat assistant support FAQ

The chat assistant answers customer questions from the product manuals. Escalate refunds
to a human agent. The assistant never sees payment data.
"""


class Command(BaseCommand):
    help = "Load the demo organisation (idempotent)."

    def add_arguments(self, parser):
        parser.add_argument("--days", type=int, default=30, help="days of simulated history")
        parser.add_argument("--seed", type=int, default=7)

    def handle(self, *args, days: int, seed: int, **opts):
        if Tenant.objects.filter(slug="vision-lab").exists():
            self.stdout.write("The demo organisation is already loaded; nothing changed.")
            return
        with transaction.atomic(), context.bound(actor_label="seed_demo", sudo=True):
            users = self._accounts()
            self._fleet(users)
            self._organisation(users)
            self._vendor_access(users)
            self._history(users, days=days, rng=random.Random(seed))  # nosec B311 # a reproducible demo history, not a secret
            self._serving(users)
        self.stdout.write(self.style.SUCCESS(
            f"Demo organisation loaded: {Tenant.objects.count()} tenants, {Project.objects.count()} projects, "
            f"{Accelerator.objects.count()} cards, {Job.objects.count()} jobs."
        ))

    # --- people ----------------------------------------------------------------------
    def _accounts(self) -> dict:
        User = get_user_model()
        users = {}
        for username, (title, _roles) in ACCOUNTS.items():
            first, _, last = title.partition(" ")
            user = User(username=username, email=f"{username}@demo.atrium.test", first_name=first[:150],
                        last_name=last[:150])
            user.set_password(DEMO_PASSWORD)
            user.save()
            users[username] = user
        admin = users["platform-admin"]
        for username, (_title, roles) in ACCOUNTS.items():
            for role in roles:
                tenancy.grant_platform_role(admin, users[username], role, bootstrap=True)
        return users

    # --- fleet -----------------------------------------------------------------------
    def _fleet(self, users) -> None:
        admin, ops = users["platform-admin"], users["ops"]
        mig80 = ["1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
        models = {
            H100: sched.create_accelerator_model(admin, name=H100, short_name="H100", vendor="nvidia",
                                                 memory_gib=80, mig_profiles=mig80, nvlink=True),
            A100: sched.create_accelerator_model(admin, name=A100, short_name="A100", vendor="nvidia",
                                                 memory_gib=80, mig_profiles=mig80, nvlink=True),
            L4: sched.create_accelerator_model(admin, name=L4, short_name="L4", vendor="nvidia", memory_gib=24),
            MI300: sched.create_accelerator_model(admin, name=MI300, short_name="MI300X", vendor="amd",
                                                  memory_gib=192, nvlink=True),
        }
        pools = {
            "h100-train": sched.create_pool(admin, name="h100-train", description="H100 SXM5 training nodes"),
            "a100-mig": sched.create_pool(admin, name="a100-mig", description="A100 in MIG mode", mig_enabled=True),
            "l4-share": sched.create_pool(admin, name="l4-share", description="L4 with fractional sharing",
                                          allows_sharing=True),
            "mi300": sched.create_pool(admin, name="mi300", description="AMD MI300X"),
        }
        layout = [("h100-train", H100, 4, 8, "gpu-h100"), ("a100-mig", A100, 2, 8, "gpu-a100"),
                  ("l4-share", L4, 4, 4, "gpu-l4"), ("mi300", MI300, 1, 8, "gpu-mi300")]
        for pool, model, count, cards, prefix in layout:
            for i in range(1, count + 1):
                sched.register_node(
                    ops, pool=pools[pool], name=f"{prefix}-{i:02d}", cpu_milli=224_000 if cards == 8 else 64_000,
                    memory_mib=(2048 if cards == 8 else 256) * 1024, model=models[model], cards=cards,
                    labels={"atrium.io/pool": pool},
                )
        # list prices per card-hour, effective before the history starts (past cost never moves)
        since = timezone.now() - dt.timedelta(days=90)
        for name, price in ((H100, "2.90"), (A100, "1.80"), (L4, "0.45"), (MI300, "2.40")):
            metering.set_price(admin, accelerator_model=models[name], per_card_hour=price, effective_from=since)
        spec = sched.create_spec
        h, a, l4, mi = [models[H100]], [models[A100]], [models[L4]], [models[MI300]]
        spec(admin, name="h100-80g x1", models=h, gpu_count=1, cpu_milli=24_000, memory_mib=192 * 1024,
             description="one H100, for fine-tuning and evaluation")
        spec(admin, name="h100-80g x4", models=h, gpu_count=4, cpu_milli=96_000, memory_mib=768 * 1024,
             description="four NVLinked H100")
        spec(admin, name="h100-80g x8", models=h, gpu_count=8, cpu_milli=192_000, memory_mib=1536 * 1024,
             description="a whole H100 node")
        spec(admin, name="a100 mig-1g.10gb", models=a, mode="mig", mig_profile="1g.10gb", cpu_milli=4_000,
             memory_mib=32 * 1024, description="smallest MIG slice, notebooks")
        spec(admin, name="a100 mig-3g.40gb", models=a, mode="mig", mig_profile="3g.40gb", cpu_milli=12_000,
             memory_mib=96 * 1024, description="half an A100, isolated")
        spec(admin, name="l4 x0.5", models=l4, mode="fraction", fraction_milli=500, cpu_milli=4_000,
             memory_mib=16 * 1024, description="half an L4, inference and notebooks")
        spec(admin, name="l4 x0.25", models=l4, mode="fraction", fraction_milli=250, cpu_milli=2_000,
             memory_mib=8 * 1024, description="a quarter L4")
        spec(admin, name="l4 x1", models=l4, gpu_count=1, cpu_milli=8_000, memory_mib=32 * 1024,
             description="one whole L4")
        spec(admin, name="mi300x x1", models=mi, gpu_count=1, cpu_milli=24_000, memory_mib=192 * 1024,
             description="one AMD MI300X")
        spec(admin, name="mi300x x8", models=mi, gpu_count=8, cpu_milli=192_000, memory_mib=1536 * 1024,
             description="the whole MI300X node")
        for name, value, preemptible, classes, description in [
            ("production", 1000, False, ["production"], "serving and business-critical; never preempted"),
            ("training", 500, True, ["production", "research"], "planned training runs"),
            ("development", 300, True, [], "interactive work and experiments"),
            ("batch", 100, True, [], "best effort; uses idle capacity and yields first"),
        ]:
            sched.save_priority_class(admin, name=name, value=value, preemptible=preemptible,
                                      allowed_project_classes=classes, allowed_roles=[], description=description)

    # --- tenants, projects, people, quotas -------------------------------------------
    def _organisation(self, users) -> None:
        admin = users["platform-admin"]
        from scheduling.models import AcceleratorModel

        model = {m.name: m for m in AcceleratorModel.objects.all()}
        plan = {
            "vision-lab": ("Vision Lab", [("detector", "Object detection", "research", "CC-4100"),
                                          ("labeling", "Labeling tools", "development", "CC-4110")],
                           {H100: (8, 16), L4: (4, 8), A100: (2, 4)}),
            "nlp-group": ("NLP Group", [("llm-finetune", "LLM fine-tuning", "research", "CC-5200"),
                                        ("chat-prod", "Chat assistant (production)", "production", "CC-5210")],
                          {H100: (12, 16), L4: (4, 8), MI300: (4, 8)}),
            "genomics": ("Genomics", [("folding", "Protein folding", "research", "CC-6300")],
                         {A100: (4, 8), MI300: (4, 8), L4: (2, 4)}),
        }
        for slug, (name, projects, gpus) in plan.items():
            tenant = tenancy.create_tenant(admin, slug=slug, name=name)
            for model_name, (g, lim) in gpus.items():
                sched.set_quota(admin, tenant=tenant, resource="gpus", accelerator_model=model[model_name],
                                guaranteed=g, limit=lim)
            sched.set_quota(admin, tenant=tenant, resource="jobs", guaranteed=20, limit=40)
            sched.set_quota(admin, tenant=tenant, resource="card_hours_month", guaranteed=10_000, limit=20_000)
            for p_slug, p_name, p_class, cc in projects:
                project = tenancy.create_project(admin, tenant, slug=p_slug, name=p_name, project_class=p_class,
                                                 cost_centre=cc)
                share = len(projects)
                for model_name, (g, lim) in gpus.items():
                    # projects may borrow up to the tenant's limit, except where the demo
                    # shows a project at its own hard limit
                    limit = 8 if (p_slug, model_name) == ("llm-finetune", H100) else lim
                    sched.set_quota(admin, tenant=tenant, project=project, resource="gpus",
                                    accelerator_model=model[model_name], guaranteed=g // share, limit=limit)
                sched.set_quota(admin, tenant=tenant, project=project, resource="jobs", guaranteed=10, limit=20)
        t = {t.slug: t for t in Tenant.objects.all()}
        p = {pr.slug: pr for pr in Project.objects.all()}
        tenancy.add_tenant_member(admin, t["vision-lab"], users["vision-admin"], "tenant_admin")
        tenancy.add_tenant_member(admin, t["nlp-group"], users["nlp-admin"], "tenant_admin")
        tenancy.add_project_member(admin, p["detector"], users["vision-user"], "user")
        tenancy.add_project_member(admin, p["llm-finetune"], users["nlp-user"], "user")
        tenancy.add_project_member(admin, p["chat-prod"], users["nlp-user"], "user")
        tenancy.add_project_member(admin, p["folding"], users["genomics-user"], "user")

    # --- vendor access ---------------------------------------------------------------
    def _vendor_access(self, users) -> None:
        from scheduling.models import Node

        now = timezone.now()
        node = Node.objects.get(name="gpu-h100-03")
        order = WorkOrder.objects.create(title="Replace fan tray on gpu-h100-03", opened_by=users["ops"],
                                         reason="Thermal alarms on cards 2 and 3; vendor RMA 88412.")
        order.nodes.add(node)
        VendorGrant.objects.create(vendor=users["vendor"], work_order=order, requested_by=users["ops"],
                                   approved_by=users["security"], starts=now - dt.timedelta(days=1),
                                   expires=now + dt.timedelta(days=6))
        VendorGrant.objects.create(vendor=users["vendor-expired"], work_order=order, requested_by=users["ops"],
                                   approved_by=users["security"], starts=now - dt.timedelta(days=10),
                                   expires=now - dt.timedelta(days=3))

    # --- model services, knowledge bases, API keys ---------------------------------------
    def _serving(self, users) -> None:
        from serving import services as serving

        p = {pr.slug: pr for pr in Project.objects.all()}
        t = {tn.slug: tn for tn in Tenant.objects.all()}
        chat = serving.create_model_service(
            users["nlp-admin"], project=p["chat-prod"], slug="chat-assistant", name="Chat assistant",
            base_model="Llama-3.1-8B-Instruct", model_version="2025-07", spec=ResourceSpec.objects.get(name="l4 x0.5"),
            priority_class=PriorityClass.objects.get(name="production"), upstream_url=DEMO_UPSTREAM,
            visibility="tenant",
        )
        serving.publish_service(users["nlp-admin"], chat)
        serving.create_api_key(users["nlp-user"], project=p["chat-prod"], name="support-bot", services=[chat])
        handbook = serving.create_knowledge_base(users["vision-admin"], tenant=t["vision-lab"], slug="lab-handbook",
                                                 name="Lab handbook", all_projects=True)
        serving.upload_document(users["vision-admin"], handbook, filename="gpu-etiquette.md", content_type="text/markdown",
                                data=HANDBOOK.encode())
        faq = serving.create_knowledge_base(users["nlp-admin"], tenant=t["nlp-group"], slug="support-faq",
                                            name="Support FAQ", all_projects=True)
        serving.upload_document(users["nlp-admin"], faq, filename="faq.md", content_type="text/markdown",
                                data=FAQ.encode())

    # --- 30 days of history on the simulated clock -----------------------------------
    def _history(self, users, *, days: int, rng: random.Random) -> None:
        p = {pr.slug: pr for pr in Project.objects.all()}
        spec = {s.name: s for s in ResourceSpec.objects.all()}
        prio = {c.name: c for c in PriorityClass.objects.all()}
        # (weight, user, project, spec, priority, minutes, name): a mix that keeps every pool busy
        workload = [
            (4, "vision-user", "detector", "h100-80g x1", "training", 240, "train-detector"),
            (2, "vision-user", "detector", "h100-80g x4", "training", 600, "detector-sweep"),
            (3, "vision-user", "detector", "l4 x0.5", "development", 120, "notebook"),
            (1, "nlp-user", "llm-finetune", "h100-80g x8", "training", 720, "llama-finetune"),
            (3, "nlp-user", "llm-finetune", "h100-80g x1", "batch", 180, "eval-batch"),
            (1, "nlp-user", "chat-prod", "l4 x0.5", "production", 1440, "chat-serving"),
            (2, "nlp-user", "llm-finetune", "mi300x x1", "development", 300, "rocm-port"),
            (3, "genomics-user", "folding", "a100 mig-3g.40gb", "training", 480, "fold-batch"),
            (3, "genomics-user", "folding", "a100 mig-1g.10gb", "development", 90, "fold-notebook"),
            (2, "genomics-user", "folding", "mi300x x1", "batch", 360, "md-sim"),
        ]
        weights = [w[0] for w in workload]
        cluster = SimulatedCluster()
        now = timezone.now()
        t = (now - dt.timedelta(days=days)).replace(minute=0, second=0, microsecond=0)
        step = dt.timedelta(hours=3)
        degraded = False
        while t < now - step:
            for _ in range(rng.choice((0, 1, 2, 2, 3))):
                _w, user, proj, spec_name, prio_name, minutes, name = rng.choices(workload, weights)[0]
                sched.submit_job(users[user], project=p[proj], spec=spec[spec_name], priority_class=prio[prio_name],
                                 name=f"{name}-{rng.randrange(1000):03d}", image="registry.demo/atrium/train:1.4",
                                 command=["python", "train.py", "--config", f"{name}.yaml"],
                                 expected_minutes=int(minutes * rng.uniform(0.5, 1.5)), submitted=t)
            run_cycle(now=t)
            cluster.tick(now=t)
            if not degraded and t > now - dt.timedelta(days=2):
                card = Accelerator.objects.get(node__name="gpu-h100-02", index=5)
                cluster.inject_fault(card, kind=HealthEventKind.XID, code=79,
                                     message="XID 79: GPU has fallen off the bus", now=t)
                degraded = True
            t += step
        # the present: some work queued with every kind of reason a person meets
        for user, proj, spec_name, prio_name, minutes, name in [
            ("nlp-user", "llm-finetune", "h100-80g x8", "training", 900, "llama-70b-pretrain"),
            ("nlp-user", "llm-finetune", "h100-80g x8", "batch", 600, "llama-ablation"),
            ("vision-user", "detector", "h100-80g x8", "training", 600, "detector-large"),
            ("genomics-user", "folding", "mi300x x8", "training", 720, "md-ensemble"),
            ("nlp-user", "chat-prod", "l4 x0.5", "production", 1440, "chat-canary"),
        ]:
            sched.submit_job(users[user], project=p[proj], spec=spec[spec_name], priority_class=prio[prio_name],
                             name=name, image="registry.demo/atrium/train:1.4",
                             command=["python", "train.py", "--config", f"{name}.yaml"], expected_minutes=minutes,
                             submitted=now - dt.timedelta(minutes=5))
        run_cycle(now=now)
        cluster.tick(now=now)
        metering.accrue(until=now)
