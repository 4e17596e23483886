"""The dashboard in a real browser (Debian's headless Chromium driven by Playwright) on the demo
organisation: a vision-lab user submits a job that fits, watches it wait with a reason, run
after a scheduling cycle (the panel updates itself through htmx), cancels it, submits one
over quota and reads the quota sentence; an nlp-group user sees nothing of vision-lab. Every
step leaves a screenshot in var/screenshots/, and the Content Security Policy must never fire.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.core.management import call_command

from portal.tests.conftest import needs_chromium

SHOTS = Path(__file__).resolve().parents[2] / "var" / "screenshots"
DEMO_PASSWORD = "atrium-demo"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    needs_chromium,
]


def new_page(browser, width=1280, height=900):
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    page.console_problems = []
    page.on("console", lambda msg: page.console_problems.append(msg.text)
            if msg.type == "error" or "Content Security Policy" in msg.text or "Refused to" in msg.text else None)
    page.on("pageerror", lambda exc: page.console_problems.append(str(exc)))
    return context, page


@pytest.fixture
def demo(transactional_db):
    call_command("seed_demo", days=2, verbosity=0)


def shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def sign_in(page, live_server, username: str) -> None:
    page.goto(f"{live_server.url}/login/")
    page.get_by_label("User name").fill(username)
    page.get_by_label("Password").fill(DEMO_PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{live_server.url}/")


def htmx_settled(page) -> None:
    """Wait until no htmx request is in flight and no swap is settling (htmx marks the element
    that issued a request with htmx-request, synchronously in the change handler)."""
    page.wait_for_function(
        "() => !document.querySelector('.htmx-request, .htmx-swapping, .htmx-settling, .htmx-added')")


def submit(page, live_server, *, spec: str, priority: str, name: str, replicas: int = 1) -> int:
    from playwright.sync_api import expect

    page.goto(f"{live_server.url}/scheduling/jobs/new/")
    project = page.locator("#id_project").first
    project.select_option(project.locator("option", has_text="detector").first.get_attribute("value"))
    htmx_settled(page)  # the project's re-render must land before the next choice, or it replaces it
    # choosing the project re-renders the dependent fields through htmx; without that (or
    # JavaScript) a first submit re-renders the form for the chosen project
    options = page.get_by_label("Priority class").locator("option", has_text=priority)
    try:
        expect(options).to_have_count(1, timeout=4_000)
    except AssertionError:
        page.get_by_role("button", name="Submit").click()
        expect(options).to_have_count(1)
    # a changed choice re-renders the dependent choices: wait for that before the next one,
    # as a person would see the page update
    with page.expect_response(lambda r: r.url.endswith("/scheduling/jobs/new/") and r.request.method == "POST"):
        page.get_by_label("Resource spec").select_option(label=spec)
    htmx_settled(page)
    if replicas != 1:
        with page.expect_response(lambda r: r.url.endswith("/scheduling/jobs/new/") and r.request.method == "POST"):
            page.get_by_label("Replicas").fill(str(replicas))
            page.get_by_label("Replicas").blur()
        htmx_settled(page)
    page.get_by_label("Priority class").select_option(label=priority)
    page.get_by_label("Name").fill(name)
    page.get_by_label("Command").fill("python train.py --epochs 1")
    page.get_by_label("Expected run time (minutes)").fill("30")
    page.get_by_role("button", name="Submit").click()
    page.wait_for_url(re.compile(r"/scheduling/jobs/\d+/$"))
    return int(re.search(r"/jobs/(\d+)/$", page.url).group(1))


def queue_row(page, name: str):
    return page.locator("#panel-queue tr", has=page.get_by_role("link", name=re.compile(rf"^\d+ {re.escape(name)}$")))


@pytest.mark.django_db(transaction=True)
def test_vision_user_submits_watches_cancels_and_hits_quota(browser, live_server, demo):
    from playwright.sync_api import expect

    from scheduling.cycle import run_cycle
    from scheduling.models import Job

    context, page = new_page(browser)
    sign_in(page, live_server, "vision-user")
    expect(page.get_by_role("heading", name="Dashboard")).to_be_visible()
    expect(page.get_by_label("Scope", exact=True)).to_have_value(re.compile(r"^project:\d+$"))
    for panel in ("Alarms", "Quota", "Queue", "Usage and cost"):
        expect(page.get_by_role("heading", name=panel, exact=True)).to_be_visible()
    expect(page.locator("#panel-usage .chart .main-svg").first).to_be_visible()  # plotly drew the chart
    shot(page, "01-dashboard-vision-user")

    job_id = submit(page, live_server, spec="l4 x0.5", priority="development", name="browser-fits")
    shot(page, "02-job-submitted")
    page.goto(f"{live_server.url}/")
    row = queue_row(page, "browser-fits")
    expect(row).to_contain_text("pending")
    expect(row).to_contain_text("Waiting for the next scheduling cycle.")
    shot(page, "03-dashboard-job-pending")

    run_cycle()  # the worker does this in production
    assert Job.objects.get(pk=job_id).state in ("admitted", "running")
    # no reload: the queue panel polls its fragment and shows the job running
    expect(page.locator("#running-h ~ .table-wrap").locator("tr", has_text="browser-fits")).to_contain_text(
        re.compile("admitted|running"), timeout=15_000)
    expect(page.locator("#panel-quota")).to_contain_text("L4 GPUs")
    shot(page, "04-dashboard-job-running")

    page.get_by_role("link", name=f"{job_id} browser-fits").click()
    page.get_by_label("Reason (optional)").fill("done testing")
    page.get_by_label(re.compile(rf"Yes, stop job {job_id}")).check()
    page.get_by_role("button", name="Cancel this job").click()
    expect(page.locator(".state").first).to_have_text("cancelled")
    shot(page, "05-job-cancelled")
    page.goto(f"{live_server.url}/")
    expect(page.locator("#panel-queue")).not_to_contain_text("browser-fits")

    submit(page, live_server, spec="h100-80g x8", priority="training", name="browser-too-big", replicas=3)
    run_cycle()
    page.goto(f"{live_server.url}/")
    row = queue_row(page, "browser-too-big")
    expect(row).to_contain_text(re.compile(r"quota", re.I))
    expect(row.locator(".reason")).to_contain_text(re.compile(r"H100", re.I))
    shot(page, "06-dashboard-over-quota")

    # keyboard: the scope switcher is reachable and shows its focus
    page.get_by_label("Scope", exact=True).focus()
    assert page.evaluate("getComputedStyle(document.activeElement).outlineStyle") != "none"
    assert page.console_problems == [], page.console_problems
    context.close()


@pytest.mark.django_db(transaction=True)
def test_nlp_user_sees_nothing_of_vision_lab(browser, live_server, demo):
    from playwright.sync_api import expect

    from scheduling.models import Job

    vision_names = set(Job.objects.filter(tenant__slug="vision-lab").values_list("name", flat=True))
    assert vision_names
    context, page = new_page(browser)
    sign_in(page, live_server, "nlp-user")
    expect(page.locator("#panel-queue")).to_be_visible()
    shot(page, "07-dashboard-nlp-user")
    texts = {"page": page.content()}
    scopes = page.get_by_label("Scope", exact=True).locator("option").evaluate_all("els => els.map(e => e.value)")
    assert scopes and all(s.startswith("project:") for s in scopes)
    for scope in scopes:
        for panel in ("alarms", "quota", "queue", "usage"):
            response = page.request.get(f"{live_server.url}/?scope={scope}&panel={panel}", headers={"HX-Request": "true"})
            assert response.ok
            texts[f"{scope} {panel}"] = response.text()
    for where, text in texts.items():
        assert "vision" not in text.lower() and "detector" not in text.lower(), where
        leaked = [n for n in vision_names if n in text]
        assert not leaked, (where, leaked[:3])
    assert page.console_problems == [], page.console_problems
    context.close()


@pytest.mark.django_db(transaction=True)
def test_tenant_dashboard_is_readable_on_a_phone(browser, live_server, demo):
    from playwright.sync_api import expect

    context, page = new_page(browser, width=390, height=844)
    sign_in(page, live_server, "vision-admin")
    expect(page.get_by_label("Scope", exact=True)).to_have_value(re.compile(r"^tenant:\d+$"))
    expect(page.locator("#panel-usage .chart .main-svg").first).to_be_visible()
    overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
    shot(page, "08-dashboard-tenant-390px")
    assert overflow <= 0, f"the page scrolls sideways by {overflow}px at 390 px"
    assert page.console_problems == [], page.console_problems
    context.close()


@pytest.mark.django_db(transaction=True)
def test_admin_adds_a_member_and_ops_quarantine_alarms_the_owner(browser, live_server, demo):
    """vision-admin adds a member through the console; ops quarantines the card a vision-lab
    job runs on; vision-user then sees the alarm on the dashboard."""
    from django.contrib.auth import get_user_model
    from playwright.sync_api import expect

    from scheduling import services
    from scheduling.cycle import run_cycle
    from scheduling.models import Binding, PriorityClass, ResourceSpec
    from tenants.models import Project, ProjectMembership, Tenant

    get_user_model().objects.create_user("new-scientist", password=DEMO_PASSWORD)
    tenant = Tenant.objects.get(slug="vision-lab")
    context, page = new_page(browser)
    sign_in(page, live_server, "vision-admin")
    page.goto(f"{live_server.url}/tenants/{tenant.pk}/members/")
    page.locator("#id_who").fill("new-scientist")
    page.locator("#id_project").select_option(label="vision-lab/detector")
    page.locator("#id_role").select_option("user")
    page.get_by_role("button", name="Add").click()
    expect(page.locator("main")).to_contain_text("new-scientist")
    shot(page, "09-tenant-admin-added-member")
    assert ProjectMembership.objects.filter(user__username="new-scientist", project__slug="detector",
                                            role="user").count() == 1
    context.close()

    vision_user = get_user_model().objects.get(username="vision-user")
    job = services.submit_job(vision_user, project=Project.objects.get(slug="detector"),
                              spec=ResourceSpec.objects.get(name="h100-80g x1"),
                              priority_class=PriorityClass.objects.get(name="training"),
                              name="alarm-watch", image="img:1", command=["python", "train.py"])
    run_cycle()
    card = Binding.objects.get(job=job, end__isnull=True).accelerator

    context, page = new_page(browser)
    sign_in(page, live_server, "ops")
    page.goto(f"{live_server.url}/scheduling/nodes/{card.node_id}/")
    row = page.locator("tr", has=page.get_by_text(card.uuid, exact=True))
    row.get_by_label("Reason").fill("XID 48 on this card, vendor called")
    row.get_by_role("button", name="Quarantine").click()
    expect(page.locator("tr", has=page.get_by_text(card.uuid, exact=True))).to_contain_text("quarantined")
    shot(page, "10-ops-quarantined-card")
    context.close()

    context, page = new_page(browser)
    sign_in(page, live_server, "vision-user")
    expect(page.locator("#panel-alarms")).to_contain_text(f"Job {job.pk}")
    expect(page.locator("#panel-alarms")).to_contain_text("lost its cards")
    shot(page, "11-vision-user-sees-alarm")
    assert page.console_problems == [], page.console_problems
    context.close()
