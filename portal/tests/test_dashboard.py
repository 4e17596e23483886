"""The dashboard: scope switching within reach only, tenant isolation in the full page and in
every htmx fragment, the numbers of the quota / queue / usage / alarm panels, and a query
budget that does not grow with the number of jobs or usage rows."""

from __future__ import annotations

import datetime as dt
import re
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from conftest import PASSWORD
from portal.dashboard import PANELS

FRAGMENT_BUDGET = 15


def login(client, user):
    assert client.login(username=user.username, password=PASSWORD)
    return client


def populate(org, slug: str, n: int, *, tag: str, start_index: int = 0) -> None:
    """n jobs in the tenant's project (a third running on a card, the rest waiting), with an
    hourly usage row for each running job: written directly, for volume only."""
    from metering.models import UsageRecord
    from scheduling.models import Accelerator, Binding, Job, JobState, WaitReason

    project, tenant = org.projects[slug], org.tenants[slug]
    people = org.people[slug]
    cards = list(Accelerator.objects.filter(model=org.models["l4"]).order_by("pk"))
    now = timezone.now()
    jobs = []
    for i in range(start_index, start_index + n):
        running = i % 3 == 0
        jobs.append(Job(
            tenant=tenant, project=project, submitter=people["user"] if i % 2 else people["admin"],
            name=f"{tag}-{i}", spec=org.specs["l4half"], priority_class=org.prio["batch"], image="img:1",
            command=["run", f"{tag}-secret-command"],
            state=JobState.RUNNING if running else JobState.PENDING,
            wait_reason=WaitReason.NONE if running else WaitReason.CAPACITY,
            wait_message="" if running else f"{tag}: no healthy node with a free L4 share",
            queue_position=None if running else i + 1,
            submitted=now - dt.timedelta(hours=3), admitted=now - dt.timedelta(hours=2) if running else None,
            started=now - dt.timedelta(hours=2) if running else None,
        ))
    Job.objects.bulk_create(jobs)
    # every running job on the first L4 (the tests quarantine the other one)
    bindings = [Binding(job=j, accelerator=cards[0], tenant=tenant, project=project, share_milli=500,
                        start=now - dt.timedelta(hours=2)) for k, j in enumerate(jobs) if j.state == JobState.RUNNING]
    Binding.objects.bulk_create(bindings)
    hour = now.replace(minute=0, second=0, microsecond=0) - dt.timedelta(hours=1)
    UsageRecord.objects.bulk_create([
        UsageRecord(hour=hour - dt.timedelta(days=k % 5), tenant=tenant, project=project,
                    accelerator_model=org.models["l4"], pool=cards[0].node.pool, job=b.job, binding=b,
                    milli_card_seconds=1800 * 1000)
        for k, b in enumerate(bindings)
    ])


@pytest.fixture
def priced(org):
    from metering.models import Price

    for model, price in ((org.models["l4"], "1.2500"), (org.models["h100"], "4.0000")):
        Price.objects.create(accelerator_model=model, per_card_hour=Decimal(price),
                             effective_from=timezone.now() - dt.timedelta(days=90))


@pytest.fixture
def alpha_alarm(org):
    from metering import services

    return services.raise_alarm(kind="quota_nearly_used", severity="warning",
                                message="alpha-p uses 95% of its L4 quota (ALPHA-ALARM-7731)",
                                action="Cancel idle notebooks or ask alpha's admin for more.",
                                project=org.projects["alpha"], dedupe_key="test:alpha:quota")


def scope_options(html: str) -> list[str]:
    return re.findall(r'<option value="([^"]+)"', html)


def panel_urls(html: str) -> dict[str, str]:
    return {m.group(2): m.group(1).replace("&amp;", "&")
            for m in re.finditer(r'hx-get="([^"]*panel=(\w+))"', html)}


# --- scope ---------------------------------------------------------------------------------


def test_switcher_offers_only_the_scopes_each_role_may_open(client, org):
    alpha, beta = org.tenants["alpha"], org.tenants["beta"]
    bp = org.projects["beta"]
    expected = {
        org.people["beta"]["user"]: [f"project:{bp.pk}"],
        org.people["beta"]["admin"]: [f"tenant:{beta.pk}", f"project:{bp.pk}"],
        org.people["beta"]["finance"]: [f"tenant:{beta.pk}", f"project:{bp.pk}"],
        org.finance: ["platform", f"tenant:{alpha.pk}", f"tenant:{beta.pk}"],
        org.admin: ["platform", f"tenant:{alpha.pk}", f"tenant:{beta.pk}"],
        org.ops: [],
    }
    for user, options in expected.items():
        html = login(client, user).get("/").content.decode()
        assert scope_options(html) == options, user.username
        client.logout()


def test_default_scope_is_the_first_project_then_tenant_then_platform(client, org):
    html = login(client, org.people["beta"]["user"]).get("/").content.decode()
    assert f'value="project:{org.projects["beta"].pk}" selected' in html
    client.logout()
    html = login(client, org.people["beta"]["admin"]).get("/").content.decode()
    assert f'value="tenant:{org.tenants["beta"].pk}" selected' in html
    client.logout()
    html = login(client, org.finance).get("/").content.decode()
    assert 'value="platform" selected' in html


@pytest.mark.parametrize("who", ["user", "admin", "finance", "viewer"])
def test_another_tenants_scope_answers_404(client, org, who):
    user = org.people["beta"][who]
    login(client, user)
    for scope in (f"project:{org.projects['alpha'].pk}", f"tenant:{org.tenants['alpha'].pk}", "platform",
                  "tenant:999999", "project:abc", "everything"):
        assert client.get("/", {"scope": scope}).status_code == 404, scope
        assert client.get("/", {"scope": scope, "panel": "queue"}, HTTP_HX_REQUEST="true").status_code == 404, scope
    # their own scope opens
    assert client.get("/", {"scope": f"project:{org.projects['beta'].pk}"}).status_code == 200


def test_tenant_member_without_usage_rights_gets_no_tenant_view(client, org, make_user):
    from tenants import services as tenancy

    member = make_user("beta-member")
    tenancy.add_tenant_member(org.admin, org.tenants["beta"], member, "member")
    login(client, member)
    assert client.get("/", {"scope": f"tenant:{org.tenants['beta'].pk}"}).status_code == 404
    assert scope_options(client.get("/").content.decode()) == []


# --- isolation -----------------------------------------------------------------------------


def test_beta_sees_nothing_of_alpha_in_the_page_or_any_fragment(client, org, priced, alpha_alarm):
    populate(org, "alpha", 12, tag="alphajob")
    populate(org, "beta", 4, tag="betajob")
    alpha_page = login(client, org.people["alpha"]["user"]).get("/").content.decode()
    # the alpha user does see all of it, so the absence below means something
    assert "alphajob-" in alpha_page and "ALPHA-ALARM-7731" in alpha_page
    alpha_cost = re.search(r"Estimated cost this month</dt><dd>([\d.,]+) EUR", alpha_page).group(1)
    assert Decimal(alpha_cost.replace(",", "")) > 0
    client.logout()
    for who in ("user", "admin", "finance", "viewer"):
        login(client, org.people["beta"][who])
        html = client.get("/").content.decode()
        pages = {"full": html}
        scopes = scope_options(html)
        assert scopes, who
        for scope in scopes:
            pages[f"full {scope}"] = client.get("/", {"scope": scope}).content.decode()
            for panel in PANELS:
                for htmx in (True, False):
                    extra = {"HTTP_HX_REQUEST": "true"} if htmx else {}
                    resp = client.get("/", {"scope": scope, "panel": panel}, **extra)
                    assert resp.status_code == 200
                    pages[f"{panel} {scope} htmx={htmx}"] = resp.content.decode()
        for name, text in pages.items():
            low = text.lower()
            assert "alpha" not in low, f"beta {who} sees alpha in {name}"
            assert "alphajob" not in low and "ALPHA-ALARM" not in text, name
            assert f"{alpha_cost} EUR" not in text or alpha_cost == "0.00", name
        client.logout()


def test_platform_finance_sees_every_tenant_but_no_job_detail(client, org, priced):
    populate(org, "alpha", 6, tag="alphajob")
    populate(org, "beta", 3, tag="betajob")
    html = login(client, org.finance).get("/", {"scope": "platform"}).content.decode()
    assert "(alpha)" in html and "(beta)" in html  # per-tenant aggregates
    assert "alphajob" not in html and "betajob" not in html and "secret-command" not in html
    queue = client.get("/", {"scope": "platform", "panel": "queue"}, HTTP_HX_REQUEST="true").content.decode()
    # 2 + 1 running (every third job), 4 + 2 waiting, counted but not named
    assert "<strong>3</strong> running" in queue and "<strong>6</strong> waiting" in queue
    assert "alphajob" not in queue and "not its jobs" in queue
    client.logout()
    admin_queue = login(client, org.admin).get("/", {"scope": "platform", "panel": "queue"},
                                                HTTP_HX_REQUEST="true").content.decode()
    assert "alphajob-0" in admin_queue and "betajob-0" in admin_queue  # platform admin does see jobs


# --- panels --------------------------------------------------------------------------------


def test_queue_lists_own_jobs_first_with_reason_position_cards_and_cost(client, org, priced):
    populate(org, "alpha", 6, tag="q")
    html = login(client, org.people["alpha"]["user"]).get(
        "/", {"scope": f"project:{org.projects['alpha'].pk}", "panel": "queue"}, HTTP_HX_REQUEST="true"
    ).content.decode()
    assert "hx-trigger=\"every 10s\"" in html and "data-poll" in html
    waiting = html.split('id="pending-h"')[1]
    names = re.findall(r">\d+ (q-\d+)</a>", waiting)
    # alpha-user submitted the odd ones: they come first, then by queue position
    assert names == ["q-1", "q-5", "q-2", "q-4"]
    assert "q: no healthy node with a free L4 share" in waiting
    running = html.split('id="running-h"')[1].split('id="pending-h"')[0]
    assert re.findall(r">\d+ (q-\d+)</a>", running) == ["q-3", "q-0"]
    # half an L4 for two hours at 1.25 per card-hour
    assert "1.25 EUR" in running and "0.50 on l-0 gpu 0 (50%)" in running
    assert "2 h 00 min" in running or "1 h 59 min" in running


def test_quota_panel_shows_authorized_allocated_available_within_healthy_capacity(client, org):
    from scheduling import services
    from scheduling.models import Accelerator

    populate(org, "alpha", 6, tag="q")  # two jobs hold half of the first L4 each: 1 card in use
    # the other L4 quarantined: no healthy L4 is free, so nothing is available below the limit
    card = Accelerator.objects.filter(model=org.models["l4"]).order_by("pk").last()
    services.set_card_health(org.ops, card, "quarantined", reason="test")
    html = login(client, org.people["alpha"]["user"]).get(
        "/", {"scope": f"project:{org.projects['alpha'].pk}", "panel": "quota"}, HTTP_HX_REQUEST="true"
    ).content.decode()
    row = re.search(r"<th scope=\"row\">L4 GPUs</th>(.*?)</tr>", html, re.S).group(1)
    cells = re.findall(r"<td>(.*?)</td>", row, re.S)
    assert cells[0] == "2" and cells[1] == "1"  # limit, guaranteed
    assert cells[2].startswith("1")  # allocated
    assert cells[3].startswith("0 ") and "0 of 1 healthy cards free" in cells[3]
    assert 'class="qbar"' in row and "width:50.0%" in row  # 1 of limit 2, all within the guarantee


def test_usage_panel_charts_card_hours_by_day_and_model(client, org, priced):
    populate(org, "alpha", 9, tag="u")  # 3 running jobs, one 0.5 card-hour row each
    html = login(client, org.people["alpha"]["user"]).get(
        "/", {"scope": f"project:{org.projects['alpha'].pk}", "panel": "usage"}, HTTP_HX_REQUEST="true"
    ).content.decode()
    assert 'data-chart="chart-hours"' in html and '<script id="chart-hours" type="application/json">' in html
    assert "Card-hours, last 30 days</dt><dd>1.50</dd>" in html
    assert '"name": "L4"' in html and '"type": "bar"' in html
    assert "<script>" not in html and "<script src" not in html  # data only; the one static script draws it


def test_full_page_loads_plotly_only_for_a_scoped_dashboard(client, org):
    html = login(client, org.people["alpha"]["user"]).get("/").content.decode()
    assert "vendor/plotly-3.7.0.min.js" in html
    client.logout()
    html = login(client, org.ops).get("/").content.decode()
    assert "vendor/plotly" not in html and "Fleet" in html


def test_alarms_panel_shows_active_alarms_of_the_scope_with_what_to_do(client, org, alpha_alarm):
    from metering import services

    url = {"scope": f"project:{org.projects['alpha'].pk}", "panel": "alarms"}
    html = login(client, org.people["alpha"]["user"]).get("/", url, HTTP_HX_REQUEST="true").content.decode()
    assert "ALPHA-ALARM-7731" in html and "Cancel idle notebooks" in html and "Quota nearly used" in html
    services.resolve_alarm("test:alpha:quota")
    html = client.get("/", url, HTTP_HX_REQUEST="true").content.decode()
    assert "ALPHA-ALARM-7731" not in html and "No active alarm." in html


# --- query budget --------------------------------------------------------------------------


def count_queries(client, path, params, **extra) -> int:
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(path, params, **extra)
    assert response.status_code == 200
    return len(ctx.captured_queries)


@pytest.mark.parametrize("who,scope_of", [
    ("alpha-user", lambda org: f"project:{org.projects['alpha'].pk}"),
    ("alpha-admin", lambda org: f"tenant:{org.tenants['alpha'].pk}"),
    ("padmin", lambda org: "platform"),
    ("fin", lambda org: "platform"),
])
def test_query_count_does_not_grow_with_jobs_or_usage(client, org, priced, alpha_alarm, who, scope_of):
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.get(username=who)
    scope = scope_of(org)
    populate(org, "alpha", 10, tag="n")
    login(client, user)
    client.get("/")  # warm caches that are per process, not per request (content types)
    small = {"page": count_queries(client, "/", {"scope": scope})}
    for panel in PANELS:
        small[panel] = count_queries(client, "/", {"scope": scope, "panel": panel}, HTTP_HX_REQUEST="true")
    populate(org, "alpha", 490, tag="n", start_index=10)
    populate(org, "beta", 100, tag="m")
    large = {"page": count_queries(client, "/", {"scope": scope})}
    for panel in PANELS:
        large[panel] = count_queries(client, "/", {"scope": scope, "panel": panel}, HTTP_HX_REQUEST="true")
    assert small == large
    for panel in PANELS:
        assert large[panel] <= FRAGMENT_BUDGET, (panel, large)
