"""Metering pages: scope of what each role sees, htmx progress polling, bounded SQL queries."""

from __future__ import annotations

import datetime as dt
import json
import re
import time

import pytest
from django.urls import reverse
from django.utils import timezone

from metering import services
from metering.models import Price, Report, ReportStatus
from portal.middleware import SUDO_SESSION_KEY
from portal.models import AuditEvent

pytestmark = pytest.mark.django_db


@pytest.fixture
def rolled(org, bind, prices):
    """4 card-hours of alpha and 6 of beta in the last days (the usage page shows recent days)."""
    day = services.day_start(timezone.now().date() - dt.timedelta(days=3))
    bind("alpha", day + dt.timedelta(hours=9), day + dt.timedelta(hours=13))
    bind("beta", day + dt.timedelta(days=1), day + dt.timedelta(days=1, hours=6))
    services.rollup(day.date(), timezone.now().date())


def chart(response, element_id: str) -> dict:
    m = re.search(rf'<script id="{element_id}" type="application/json">(.*?)</script>', response.content.decode(), re.S)
    assert m, f"no {element_id} figure"
    return json.loads(m.group(1))


def test_usage_page_shows_own_tenant_only_with_a_plotly_figure(client, org, rolled, django_assert_max_num_queries):
    client.force_login(org.people["alpha"]["admin"])
    with django_assert_max_num_queries(25):
        r = client.get(reverse("metering:usage"), {"days": 7, "by": "project"})
    assert r.status_code == 200
    fig = chart(r, "usage-hours")
    assert {trace["name"] for trace in fig["data"]} == {"alpha-p"}
    assert sum(sum(trace["y"]) for trace in fig["data"]) == pytest.approx(4.0)
    assert b'data-chart="usage-hours"' in r.content and b"plotly-3.7.0.min.js" in r.content
    assert b"Capacity per pool" not in r.content  # idle cost per pool is finance's view


def test_finance_usage_page_has_every_tenant_and_pool_capacity(client, org, rolled, django_assert_max_num_queries):
    client.force_login(org.finance)
    with django_assert_max_num_queries(25):
        r = client.get(reverse("metering:usage"), {"days": 7, "by": "tenant"})
    assert {trace["name"] for trace in chart(r, "usage-hours")["data"]} == {"alpha", "beta"}
    assert b"Capacity per pool" in r.content


def test_people_without_usage_rights_get_no_metering_pages(client, make_user):
    client.force_login(make_user("nobody"))
    for name in ("metering:usage", "metering:report_list", "metering:budget_list", "metering:price_list"):
        assert client.get(reverse(name)).status_code == 404, name


def test_report_of_another_tenant_is_404_and_progress_polling_stops_when_done(client, org, rolled):
    today = timezone.now().date()
    report = services.request_report(org.people["alpha"]["admin"], tenant=org.tenants["alpha"],
                                     period_start=today - dt.timedelta(days=10), period_end=today + dt.timedelta(days=1),
                                     grouping="project", mode="showback", enqueue=False)
    client.force_login(org.people["beta"]["admin"])
    assert client.get(reverse("metering:report_detail", args=[report.pk])).status_code == 404
    assert client.get(reverse("metering:report_download", args=[report.pk, "csv"])).status_code == 404
    client.force_login(org.people["alpha"]["admin"])
    r = client.get(reverse("metering:report_detail", args=[report.pk]), HTTP_HX_REQUEST="true")
    assert r.status_code == 200 and b"<progress" in r.content  # still queued: keep polling
    services.build_report(report.pk)
    r = client.get(reverse("metering:report_detail", args=[report.pk]), HTTP_HX_REQUEST="true")
    assert r.status_code == 286 and b"FOCUS" in r.content
    r = client.get(reverse("metering:report_download", args=[report.pk, "csv"]))
    body = b"".join(r.streaming_content).decode()
    assert "alpha-p" in body and "beta" not in body


def test_report_page_charts_its_period_and_scope_over_time(client, org, rolled, django_assert_max_num_queries):
    today = timezone.now().date()
    period = {"period_start": today - dt.timedelta(days=10), "period_end": today + dt.timedelta(days=1),
              "grouping": "project", "mode": "showback", "enqueue": False}
    mine = services.request_report(org.people["alpha"]["admin"], tenant=org.tenants["alpha"], **period)
    client.force_login(org.people["alpha"]["admin"])
    with django_assert_max_num_queries(25):
        r = client.get(reverse("metering:report_detail", args=[mine.pk]))
    assert b"plotly-3.7.0.min.js" in r.content and b'data-chart="report-cost"' in r.content
    fig = chart(r, "report-hours")
    assert {trace["name"] for trace in fig["data"]} == {"alpha-p"}  # the tenant's report: its projects only
    assert sum(sum(trace["y"]) for trace in fig["data"]) == pytest.approx(4.0)
    assert len(fig["data"][0]["x"]) == 11  # one bar per day of the period
    finance = services.request_report(org.finance, **{**period, "grouping": "tenant"})
    client.force_login(org.finance)
    fig = chart(client.get(reverse("metering:report_detail", args=[finance.pk])), "report-hours")
    assert {trace["name"] for trace in fig["data"]} == {"alpha", "beta"}
    assert sum(sum(trace["y"]) for trace in fig["data"]) == pytest.approx(10.0)


def test_report_list_creates_a_report_in_scope_and_lists_with_bounded_queries(
        client, org, rolled, django_assert_max_num_queries, django_capture_on_commit_callbacks):
    client.force_login(org.people["alpha"]["finance"])
    with django_capture_on_commit_callbacks(execute=False):
        r = client.post(reverse("metering:report_list"), {
            "scope": f"t{org.tenants['alpha'].pk}", "period_start": "2025-03-01", "period_end": "2025-04-01",
            "grouping": "tenant", "mode": "chargeback"})
    report = Report.objects.get()
    assert r.status_code == 302 and report.tenant == org.tenants["alpha"] and report.status == ReportStatus.QUEUED
    # another tenant is not even a choice
    r = client.post(reverse("metering:report_list"), {
        "scope": f"t{org.tenants['beta'].pk}", "period_start": "2025-03-01", "period_end": "2025-04-01",
        "grouping": "tenant", "mode": "chargeback"})
    assert r.status_code == 200 and Report.objects.count() == 1
    for _ in range(5):
        services.request_report(org.people["alpha"]["finance"], tenant=org.tenants["alpha"],
                                period_start=dt.date(2025, 3, 1), period_end=dt.date(2025, 4, 1),
                                grouping="day", mode="showback", enqueue=False)
    with django_assert_max_num_queries(20):
        r = client.get(reverse("metering:report_list"))
    assert r.content.decode().count("every tenant") == 0 and r.content.decode().count("tenant alpha") >= 6


def test_budget_pages_list_spend_and_edit_through_the_service(client, org, rolled, django_assert_max_num_queries):
    services.set_budget(org.admin, tenant=org.tenants["alpha"], unit="card_hours", amount=100)
    services.set_budget(org.admin, tenant=org.tenants["beta"], unit="card_hours", amount=100)
    client.force_login(org.people["alpha"]["admin"])
    with django_assert_max_num_queries(30):
        r = client.get(reverse("metering:budget_list"))
    assert b"alpha (tenant)" in r.content and b"beta" not in r.content
    r = client.post(reverse("metering:budget_create"), {
        "scope": f"p{org.projects['alpha'].pk}", "unit": "money", "amount": "50", "mode": "block",
        "thresholds": "50, 90, 100"})
    assert r.status_code == 302
    budget = org.projects["alpha"].budgets.get()
    assert budget.mode == "block" and budget.thresholds == [50, 90, 100]


def test_price_page_lists_prices_and_changing_one_needs_sudo(client, org, prices):
    client.force_login(org.finance)
    r = client.get(reverse("metering:price_list"))
    assert b"H100-SXM5-80GB" in r.content and b"Set a card-hour price" not in r.content
    assert client.post(reverse("metering:price_list"), {}).status_code == 403
    client.force_login(org.admin)
    session = client.session
    session.pop(SUDO_SESSION_KEY, None)  # signed in a while ago: no recent re-authentication
    session.save()
    r = client.post(reverse("metering:price_list"), {"accelerator_model": org.models["l4"].pk, "per_card_hour": "9"})
    assert r.status_code == 302 and r["Location"].startswith(reverse("reauthenticate"))
    assert not Price.objects.filter(per_card_hour=9).exists()
    session = client.session
    session[SUDO_SESSION_KEY] = time.time()  # just re-authenticated
    session.save()
    r = client.post(reverse("metering:price_list"), {"accelerator_model": org.models["l4"].pk, "per_card_hour": "9"})
    assert r.status_code == 302 and Price.objects.filter(per_card_hour=9).count() == 1
    assert AuditEvent.objects.filter(action="metering.price.set", outcome="success").count() == 1
