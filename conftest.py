"""Shared test fixtures: a small two-tenant organisation built through the real services.

Tests run against PostgreSQL and Redis (see the Makefile's test target). The `org` fixture
is deliberately small; tests that need the full demo call `seed_demo` themselves.
"""

from __future__ import annotations

import os
import sys

import pytest
from django.contrib.auth import get_user_model
from django.core.servers.basehttp import ThreadedWSGIServer
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

from portal import context

PASSWORD = "a-test-password-9f3k"

# The live server (pytest-django's live_server: Django's ThreadedWSGIServer) listens with a
# backlog of 10. Tests that open 32 connections at once overflow it: 17 listen overflows in one
# run of the gateway's 200-concurrent-requests test (`nstat`), none with this backlog; in one
# clean-clone CI run on a loaded machine a request of that test failed with "connection reset
# by peer", a failure of the test server's queue, not of the gateway. Production listens with
# gunicorn's backlog of 2048; so does the test server.
ThreadedWSGIServer.request_queue_size = 2048


@pytest.fixture(autouse=True)
def _metering_written_within_the_test():
    """A request a test's live server answered is metered by the writer thread
    (serving.meterwriter): written before the next test empties the tables, and the writer's
    own connection closed before the test database is dropped."""
    yield
    meterwriter = sys.modules.get("serving.meterwriter")
    if meterwriter is not None and meterwriter.writer.pending():
        assert meterwriter.writer.flush(), "the metering writer did not finish within its timeout"


@pytest.fixture(scope="session", autouse=True)
def _meter_writer_stopped_at_the_end(django_db_setup):
    yield
    meterwriter = sys.modules.get("serving.meterwriter")
    if meterwriter is not None:
        meterwriter.writer.stop()

# Hypothesis budgets. `make test` runs the default profile: each fuzz test keeps its own small,
# mostly derandomized budget. `make fuzz` sets ATRIUM_HYPOTHESIS_PROFILE=fuzz: fresh random
# examples, no deadline, and at least ATRIUM_FUZZ_EXAMPLES examples per fuzz test (the tests
# read hypothesis_settings.default.max_examples when this profile is loaded).
hypothesis_settings.register_profile(
    "fuzz", max_examples=int(os.environ.get("ATRIUM_FUZZ_EXAMPLES", "1000")), deadline=None, derandomize=False,
    print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                            HealthCheck.function_scoped_fixture],
)
hypothesis_settings.load_profile(os.environ.get("ATRIUM_HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def make_user(db):
    User = get_user_model()

    def make(username: str, **extra):
        user = User.objects.create_user(username=username, password=PASSWORD, email=f"{username}@t.test", **extra)
        return user

    return make


@pytest.fixture
def sudo():
    """Run service calls as if the actor had just re-authenticated (sudo mode)."""
    with context.bound(sudo=True):
        yield


@pytest.fixture
def org(db, make_user, sudo):
    """Two tenants (alpha, beta), one project each, a small fleet, quotas and role holders."""
    from scheduling import services as sched
    from tenants import services as tenancy

    admin = make_user("padmin")
    tenancy.grant_platform_role(admin, admin, "platform_admin", bootstrap=True)
    ops = make_user("opsy")
    tenancy.grant_platform_role(admin, ops, "ops_engineer", bootstrap=True)
    security = make_user("secu")
    tenancy.grant_platform_role(admin, security, "security_admin", bootstrap=True)
    finance = make_user("fin")
    tenancy.grant_platform_role(admin, finance, "finance", bootstrap=True)
    auditor = make_user("aud")
    tenancy.grant_platform_role(admin, auditor, "auditor", bootstrap=True)

    h100 = sched.create_accelerator_model(admin, name="H100-SXM5-80GB", short_name="H100", vendor="nvidia",
                                          memory_gib=80, nvlink=True,
                                          mig_profiles=["1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"])
    l4 = sched.create_accelerator_model(admin, name="L4-24GB", short_name="L4", vendor="nvidia", memory_gib=24)
    train = sched.create_pool(admin, name="train")
    share = sched.create_pool(admin, name="share", allows_sharing=True)
    nodes = [
        sched.register_node(ops, pool=train, name=f"h-{i}", cpu_milli=128_000, memory_mib=1024 * 1024,
                            model=h100, cards=4)
        for i in range(2)
    ]
    nodes.append(sched.register_node(ops, pool=share, name="l-0", cpu_milli=64_000, memory_mib=256 * 1024,
                                     model=l4, cards=2))
    specs = {
        "h1": sched.create_spec(admin, name="h100 x1", models=[h100], gpu_count=1, cpu_milli=8_000,
                                memory_mib=64 * 1024),
        "h4": sched.create_spec(admin, name="h100 x4", models=[h100], gpu_count=4, cpu_milli=32_000,
                                memory_mib=256 * 1024),
        "l4half": sched.create_spec(admin, name="l4 x0.5", models=[l4], mode="fraction", fraction_milli=500,
                                    cpu_milli=2_000, memory_mib=8 * 1024),
    }
    prio = {}
    for name, value, preemptible, classes in [("production", 1000, False, ["production"]),
                                              ("training", 500, True, ["production", "research"]),
                                              ("batch", 100, True, [])]:
        prio[name] = sched.save_priority_class(admin, name=name, value=value, preemptible=preemptible,
                                               allowed_project_classes=classes, allowed_roles=[])
    tenants, projects, people = {}, {}, {}
    for slug, pclass in (("alpha", "research"), ("beta", "production")):
        tenant = tenancy.create_tenant(admin, slug=slug, name=slug.title())
        tenants[slug] = tenant
        sched.set_quota(admin, tenant=tenant, resource="gpus", accelerator_model=h100, guaranteed=2, limit=4)
        sched.set_quota(admin, tenant=tenant, resource="gpus", accelerator_model=l4, guaranteed=1, limit=2)
        project = tenancy.create_project(admin, tenant, slug=f"{slug}-p", name=f"{slug} project",
                                         project_class=pclass)
        projects[slug] = project
        sched.set_quota(admin, tenant=tenant, project=project, resource="gpus", accelerator_model=h100,
                        guaranteed=2, limit=4)
        sched.set_quota(admin, tenant=tenant, project=project, resource="gpus", accelerator_model=l4,
                        guaranteed=1, limit=2)
        tadmin = make_user(f"{slug}-admin")
        tenancy.add_tenant_member(admin, tenant, tadmin, "tenant_admin")
        user = make_user(f"{slug}-user")
        tenancy.add_project_member(admin, project, user, "user")
        viewer = make_user(f"{slug}-viewer")
        tenancy.add_project_member(admin, project, viewer, "viewer")
        fviewer = make_user(f"{slug}-finance")
        tenancy.add_tenant_member(admin, tenant, fviewer, "finance_viewer")
        people[slug] = {"admin": tadmin, "user": user, "viewer": viewer, "finance": fviewer}

    class Org:
        pass

    o = Org()
    o.admin, o.ops, o.security, o.finance, o.auditor = admin, ops, security, finance, auditor
    o.models = {"h100": h100, "l4": l4}
    o.nodes, o.specs, o.prio = nodes, specs, prio
    o.tenants, o.projects, o.people = tenants, projects, people
    return o
