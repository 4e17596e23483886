"""The portal in a real browser (Debian's headless Chromium driven by Playwright): sign-in,
the dashboard under the Content Security Policy, htmx live updates, keyboard reachability."""

from __future__ import annotations

from pathlib import Path

import pytest

from portal.tests.conftest import needs_chromium

ARTIFACTS = Path(__file__).resolve().parents[2] / "var" / "screenshots"

pytestmark = [
    pytest.mark.browser,
    needs_chromium,
]


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.csp_violations = []
    page.on("console", lambda msg: page.csp_violations.append(msg.text)
            if "Content Security Policy" in msg.text or "Refused to" in msg.text else None)
    yield page
    context.close()


def sign_in(page, live_server, username: str) -> None:
    from conftest import PASSWORD

    page.goto(f"{live_server.url}/login/")
    page.get_by_label("User name").fill(username)
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{live_server.url}/")


@pytest.mark.django_db(transaction=True)
def test_sign_in_and_dashboard_under_csp(page, live_server, org):
    from scheduling import services

    services.submit_job(org.people["alpha"]["user"], project=org.projects["alpha"], spec=org.specs["h1"],
                        priority_class=org.prio["training"], name="resnet-sweep", image="img:1", command=["train"])
    sign_in(page, live_server, "alpha-user")
    assert page.get_by_role("heading", name="Dashboard").is_visible()
    assert page.get_by_text("resnet-sweep").is_visible()
    assert "beta" not in page.content()
    assert page.evaluate("typeof window.htmx") == "object", "htmx must load from /static under the CSP"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "signed-in-project-user.png"), full_page=True)
    assert page.csp_violations == []


@pytest.mark.django_db(transaction=True)
def test_job_detail_updates_live_without_reload(page, live_server, org):
    from scheduling import services
    from scheduling.cycle import run_cycle

    user = org.people["alpha"]["user"]
    job = services.submit_job(user, project=org.projects["alpha"], spec=org.specs["h1"],
                              priority_class=org.prio["training"], name="live-job", image="img:1", command=["x"])
    sign_in(page, live_server, "alpha-user")
    page.goto(f"{live_server.url}/scheduling/jobs/{job.pk}/")
    assert page.locator(".state").first.inner_text() == "pending"
    run_cycle()
    # the fragment polls every 5 s; the page changes without a reload
    from playwright.sync_api import expect

    expect(page.locator(".state").first).to_have_text("admitted", timeout=12_000)
    services.cancel_job(user, job)
    expect(page.locator(".state").first).to_have_text("cancelled", timeout=12_000)
    assert page.csp_violations == []


@pytest.mark.django_db(transaction=True)
def test_keyboard_reaches_sign_in_and_focus_is_visible(page, live_server, org):
    page.goto(f"{live_server.url}/login/")
    page.keyboard.press("Tab")  # skip link first
    assert page.evaluate("document.activeElement.className") == "skip"
    page.keyboard.press("Tab")
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") in ("id_username", "id_password")
    outline = page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
    assert outline != "none"


@pytest.mark.django_db(transaction=True)
def test_dashboard_readable_on_a_phone(browser, live_server, org):
    context = browser.new_context(viewport={"width": 390, "height": 844})
    page = context.new_page()
    sign_in(page, live_server, "alpha-user")
    overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
    context.close()
    assert overflow <= 0, f"the page scrolls sideways by {overflow}px at 390 px"
