"""Reports built by a real RQ worker: scope by role, lines sum to the total in every format,
the FOCUS header and types, and prices that change without moving past cost."""

from __future__ import annotations

import csv
import datetime as dt
import io
import json
import re
from decimal import Decimal

import pytest
from django.core.exceptions import PermissionDenied
from openpyxl import load_workbook

from metering import exports, services
from metering.models import Report, ReportGrouping, ReportMode, ReportStatus
from metering.tests.conftest import run_burst, t
from portal import context
from portal.models import AuditEvent
from portal.services import SudoRequired

pytestmark = pytest.mark.django_db

MARCH, APRIL = dt.date(2025, 3, 1), dt.date(2025, 4, 1)
FOCUS_MANDATORY = [
    "BilledCost", "BillingAccountId", "BillingAccountName", "BillingCurrency", "BillingPeriodEnd",
    "BillingPeriodStart", "ChargeCategory", "ChargeClass", "ChargeDescription", "ChargePeriodEnd",
    "ChargePeriodStart", "ContractedCost", "EffectiveCost", "InvoiceIssuerName", "ListCost", "PricingQuantity",
    "PricingUnit", "ProviderName", "PublisherName", "ServiceCategory", "ServiceName",
]
ISO_UTC = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
# FOCUS 1.2's data type of every column Atrium writes, written out from the specification (not
# read from the exporter): Decimal, Date/Time (ISO 8601 in UTC), Currency Code (ISO 4217),
# Key-Value Format (a JSON object) or String.
FOCUS_SPEC_TYPES = {
    **dict.fromkeys(["BilledCost", "ContractedCost", "ContractedUnitPrice", "ConsumedQuantity", "EffectiveCost",
                     "ListCost", "ListUnitPrice", "PricingQuantity"], "Decimal"),
    **dict.fromkeys(["BillingPeriodEnd", "BillingPeriodStart", "ChargePeriodEnd", "ChargePeriodStart"], "DateTime"),
    **dict.fromkeys(["BillingCurrency", "PricingCurrency"], "CurrencyCode"),
    "Tags": "JSON",
    **dict.fromkeys(["BillingAccountId", "BillingAccountName", "BillingAccountType", "ChargeCategory", "ChargeClass",
                     "ChargeDescription", "ChargeFrequency", "ConsumedUnit", "InvoiceIssuerName", "PricingCategory",
                     "PricingUnit", "ProviderName", "PublisherName", "RegionId", "RegionName", "ResourceId",
                     "ResourceName", "ResourceType", "ServiceCategory", "ServiceName", "ServiceSubcategory", "SkuId",
                     "SkuPriceId", "SubAccountId", "SubAccountName", "SubAccountType"], "String"),
}
# mandatory columns the specification does not allow to be null on a usage row
FOCUS_NOT_NULL = ["BilledCost", "BillingAccountId", "BillingCurrency", "BillingPeriodEnd", "BillingPeriodStart",
                  "ChargeCategory", "ChargePeriodEnd", "ChargePeriodStart", "ContractedCost", "EffectiveCost",
                  "ListCost", "PricingQuantity", "PricingUnit", "ServiceCategory", "ServiceName"]


@pytest.fixture
def usage(org, bind, prices):
    l4 = org.nodes[2].accelerators.order_by("pk").first()
    bind("alpha", t(2025, 3, 3, 9), t(2025, 3, 3, 13, 20))
    bind("alpha", t(2025, 3, 10, 22), t(2025, 3, 11, 3), card=l4, share_milli=500)
    bind("beta", t(2025, 3, 5, 0), t(2025, 3, 6, 0), share_milli=1000)
    bind("beta", t(2025, 3, 31, 23), t(2025, 4, 1, 2))  # only one hour in March
    services.rollup(dt.date(2025, 3, 1), dt.date(2025, 4, 1), now=t(2025, 4, 2))


def build(actor, rq_queues, django_capture_on_commit_callbacks, **kw) -> tuple[Report, dict]:
    kw = {"period_start": MARCH, "period_end": APRIL, "grouping": ReportGrouping.PROJECT,
          "mode": ReportMode.SHOWBACK, **kw}
    with django_capture_on_commit_callbacks(execute=True):
        report = services.request_report(actor, **kw)
    run_burst(rq_queues)
    report.refresh_from_db()
    assert report.status == ReportStatus.DONE, report.error
    files = {
        "csv": list(csv.DictReader(io.StringIO(report.csv_file.read().decode()))),
        "focus": list(csv.DictReader(io.StringIO(report.focus_file.read().decode()))),
        "xlsx": [list(r) for r in load_workbook(report.xlsx_file.open("rb")).active.iter_rows(values_only=True)],
    }
    return report, files


def test_tenant_admin_report_has_no_row_of_another_tenant_in_any_format(
        org, usage, rq_queues, django_capture_on_commit_callbacks):
    for actor in (org.people["alpha"]["admin"], org.people["alpha"]["finance"]):
        report, files = build(actor, rq_queues, django_capture_on_commit_callbacks, tenant=org.tenants["alpha"])
        lines = [r for r in files["csv"] if r["tenant"] != "TOTAL"]
        assert {r["tenant"] for r in lines} == {"alpha"}
        assert {r[0] for r in files["xlsx"][1:-1]} == {"alpha"}
        assert {r["x_TenantName"] for r in files["focus"]} == {"alpha"}
        assert all(json.loads(r["Tags"])["tenant"] == "alpha" for r in files["focus"])
        assert "beta" not in report.csv_file.open("rb").read().decode()
    with pytest.raises(PermissionDenied):
        services.request_report(org.people["alpha"]["admin"], tenant=org.tenants["beta"], period_start=MARCH,
                                period_end=APRIL, grouping="tenant", mode="showback", enqueue=False)
    with pytest.raises(PermissionDenied):  # every tenant is finance's scope only
        services.request_report(org.people["alpha"]["admin"], period_start=MARCH, period_end=APRIL,
                                grouping="tenant", mode="showback", enqueue=False)


def test_project_member_report_is_the_project_only(org, usage, rq_queues, django_capture_on_commit_callbacks):
    report, files = build(org.people["beta"]["viewer"], rq_queues, django_capture_on_commit_callbacks,
                          project=org.projects["beta"])
    assert {(r["tenant"], r["project"]) for r in files["csv"][:-1]} == {("beta", "beta-p")}
    assert report.total_card_hours == Decimal(25)


def test_finance_report_has_every_tenant_and_lines_sum_to_the_total_in_every_format(
        org, usage, rq_queues, django_capture_on_commit_callbacks):
    for mode in (ReportMode.SHOWBACK, ReportMode.CHARGEBACK):
        report, files = build(org.finance, rq_queues, django_capture_on_commit_callbacks, mode=mode)
        lines, total = files["csv"][:-1], files["csv"][-1]
        assert {"alpha", "beta"} <= {r["tenant"] for r in lines}
        assert total["tenant"] == "TOTAL"
        assert sum(Decimal(r["cost"]) for r in lines) == Decimal(total["cost"]) == report.total_cost
        assert sum(Decimal(r["card_hours"]) for r in lines) == Decimal(total["card_hours"])
        header, *xrows, xtotal = files["xlsx"]
        cost_col = header.index("cost")
        assert xtotal[0] == "TOTAL"
        assert sum(Decimal(str(r[cost_col])) for r in xrows) == Decimal(str(xtotal[cost_col]))
        assert abs(Decimal(str(xtotal[cost_col])) - report.total_cost) < Decimal("0.000001")
        assert sum(Decimal(r["BilledCost"]) for r in files["focus"]) == report.total_cost
        # used card time: 4h20 H100 + 2.5 L4 card-hours + 24 h + 1 h H100 (April's 2 h are out)
        used = sum(Decimal(r["card_hours"]) for r in lines if r["tenant"] != exports.IDLE)
        assert abs(used - Decimal("31.833333")) < Decimal("0.00001")
        if mode == ReportMode.SHOWBACK:
            assert any(r["tenant"] == exports.IDLE for r in lines)  # idle apart, for finance
        else:
            assert not any(r["tenant"] == exports.IDLE for r in lines)
            assert sum(Decimal(r["idle_share"]) for r in lines) > 0  # idle spread over tenants by use


def test_focus_export_has_the_mandatory_columns_with_their_types(
        org, usage, rq_queues, django_capture_on_commit_callbacks):
    from metering.models import TokenPrice, TokenUsage

    # a token line too (the fixture's usage is card time only): its row must be typed as well
    TokenPrice.objects.create(model_name="demo-llm", per_million_input=Decimal("1.0000"),
                              per_million_output=Decimal("2.0000"), effective_from=t(2020, 1, 1))
    TokenUsage.objects.create(hour=t(2025, 3, 7, 10), tenant=org.tenants["alpha"], project=org.projects["alpha"],
                              api_key="atr_test", model_service="chat", model_name="demo-llm", input_tokens=1500,
                              output_tokens=500, requests=3)
    report, files = build(org.finance, rq_queues, django_capture_on_commit_callbacks, grouping=ReportGrouping.DAY)
    assert {row["ConsumedUnit"] for row in files["focus"]} == {"GPU-Hours", "1000 Tokens"}
    header = next(csv.reader(io.StringIO(report.focus_file.open("rb").read().decode())))
    assert set(FOCUS_MANDATORY) <= set(header)
    spec_like = {c for c in header if not c.startswith("x_")}
    assert spec_like <= {c for c, _ in exports.FOCUS_COLUMNS}
    assert all(c[0].isupper() for c in spec_like)  # non-spec columns must carry the x_ prefix
    assert spec_like <= set(FOCUS_SPEC_TYPES)  # every spec column written has its spec type below
    types = {**dict(exports.FOCUS_COLUMNS), **FOCUS_SPEC_TYPES}  # the exporter's own only for x_ columns
    assert files["focus"]
    for row in files["focus"]:
        assert all(row[col] != "" for col in FOCUS_NOT_NULL), {c: row[c] for c in FOCUS_NOT_NULL}
        for col, value in row.items():
            kind = types[col]
            if value == "" and col not in FOCUS_NOT_NULL:
                continue  # a nullable column left null
            if kind == "Decimal":
                Decimal(value)
            elif kind == "DateTime":
                assert ISO_UTC.match(value), (col, value)
            elif kind == "CurrencyCode":
                assert value == report.currency and re.fullmatch(r"[A-Z]{3}", value)
            elif kind == "JSON":
                assert isinstance(json.loads(value), dict)
        assert row["ChargeCategory"] in {"Usage", "Purchase", "Tax", "Credit", "Adjustment"}
        assert row["ChargeClass"] in {"", "Correction"}
        assert row["ConsumedUnit"] in {"GPU-Hours", "1000 Tokens"}
        start = dt.datetime.fromisoformat(row["ChargePeriodStart"].replace("Z", "+00:00"))
        end = dt.datetime.fromisoformat(row["ChargePeriodEnd"].replace("Z", "+00:00"))
        assert end - start == dt.timedelta(days=1)  # grouped by day: daily charge periods
        assert Decimal(row["BilledCost"]) == Decimal(row["ListCost"]) + Decimal(row["x_IdleShareCost"])


@pytest.mark.django_db
def test_price_change_applies_from_its_date_and_past_cost_does_not_move(org, bind, prices, sudo):
    from metering.models import Granularity, UsageRollup

    bind("alpha", t(2025, 3, 3, 0), t(2025, 3, 3, 10))
    services.rollup(dt.date(2025, 3, 3), dt.date(2025, 3, 3), now=t(2025, 3, 4))
    before = UsageRollup.objects.get(granularity=Granularity.DAY).cost
    assert before == Decimal("20.000000")
    n = AuditEvent.objects.filter(action="metering.price.set").count()
    services.set_price(org.admin, accelerator_model=org.models["h100"], per_card_hour="3.5")
    assert AuditEvent.objects.filter(action="metering.price.set", outcome="success").count() == n + 1
    services.rollup(dt.date(2025, 3, 3), dt.date(2025, 3, 3), now=t(2025, 3, 4))
    assert UsageRollup.objects.get(granularity=Granularity.DAY).cost == before
    with pytest.raises(PermissionDenied):  # backdating over accrued usage would move past cost
        services.set_price(org.admin, accelerator_model=org.models["h100"], per_card_hour="1",
                           effective_from=t(2025, 3, 1))


@pytest.mark.django_db
def test_changing_a_price_list_needs_manage_policy_and_sudo(org):
    with context.bound(sudo=False), pytest.raises(SudoRequired):
        services.set_price(org.admin, accelerator_model=org.models["l4"], per_card_hour="1")
    with pytest.raises(PermissionDenied):
        services.set_price(org.finance, accelerator_model=org.models["l4"], per_card_hour="1")
    denied = AuditEvent.objects.filter(action="metering.price.set", outcome="denied").count()
    assert denied == 2


def test_card_time_of_a_model_services_replicas_is_the_services_in_the_report(
        org, usage, bind, rq_queues, django_capture_on_commit_callbacks):
    """The ledger row's job is the service's job: grouped by model service, the replicas' card
    hours and cost are the service's line (and its FOCUS rows say so), batch jobs stay apart."""
    from serving.models import ModelService, ServiceStatus

    replica = bind("alpha", t(2025, 3, 20, 0), t(2025, 3, 20, 6))  # 6 card-hours of H100 at 2.00
    ModelService.objects.create(
        tenant=org.tenants["alpha"], project=org.projects["alpha"], slug="chat-svc", name="chat", base_model="demo-llm",
        spec=org.specs["h1"], priority_class=org.prio["training"], upstream_url="http://127.0.0.1:9/v1",
        created_by=org.people["alpha"]["user"], status=ServiceStatus.PUBLISHED, job=replica.job)
    services.rollup(dt.date(2025, 3, 20), dt.date(2025, 3, 20), now=t(2025, 4, 2))
    report, files = build(org.finance, rq_queues, django_capture_on_commit_callbacks,
                          grouping=ReportGrouping.MODEL_SERVICE)
    lines, total = {r["model_service"]: r for r in files["csv"][:-1]}, files["csv"][-1]
    assert Decimal(lines["chat-svc"]["card_hours"]) == 6 and Decimal(lines["chat-svc"]["cost"]) == 12
    assert abs(Decimal(lines[exports.NO_SERVICE]["card_hours"]) - Decimal("31.833333")) < Decimal("0.00001")
    assert sum(Decimal(r["cost"]) for r in lines.values()) == Decimal(total["cost"]) == report.total_cost
    service_rows = [r for r in files["focus"] if r["x_ModelService"] == "chat-svc"]
    assert sum(Decimal(r["ConsumedQuantity"]) for r in service_rows) == 6
    assert {r["SubAccountId"] for r in service_rows} == {str(org.projects["alpha"].pk)}


def test_faulty_card_time_is_reported_apart_for_finance_and_never_as_idle_or_a_tenants_cost(
        org, bind, prices, rq_queues, django_capture_on_commit_callbacks):
    from metering.models import Granularity, PoolCapacity
    from scheduling.models import Accelerator, Health, HealthEvent

    cards = list(Accelerator.objects.filter(model=org.models["h100"]).order_by("pk"))
    bind("alpha", t(2025, 3, 4, 0), t(2025, 3, 5, 0), card=cards[0])
    HealthEvent.objects.create(accelerator=cards[1], time=t(2025, 3, 4, 12), kind="xid", message="xid 79",
                               resulting_health=Health.QUARANTINED)
    services.rollup(dt.date(2025, 3, 1), dt.date(2025, 3, 31), now=t(2025, 4, 2))
    days = PoolCapacity.objects.filter(granularity=Granularity.DAY, period__gte=MARCH, period__lt=APRIL)
    faulty = sum(c.faulty_cost for c in days)
    idle = sum(c.idle_cost for c in days)
    assert faulty > 0 and idle > 0
    for mode in (ReportMode.SHOWBACK, ReportMode.CHARGEBACK):
        report, files = build(org.finance, rq_queues, django_capture_on_commit_callbacks, mode=mode,
                              grouping=ReportGrouping.TENANT)
        lines = {r["tenant"]: Decimal(r["cost"]) for r in files["csv"][:-1]}
        assert lines[exports.FAULTY] == faulty.quantize(Decimal("0.000001"))  # apart, in both modes
        assert sum(lines.values()) == report.total_cost
        if mode == ReportMode.SHOWBACK:
            assert lines[exports.IDLE] == idle.quantize(Decimal("0.000001"))  # idle without the faulty time
        else:  # idle spread by use where the pool was used (alpha's), apart where nobody used it; faulty never
            assert lines["alpha"] > Decimal(48) and lines["alpha"] + lines[exports.IDLE] == Decimal(48) + idle
        rows = [r for r in files["focus"] if r["x_ModelService"] == exports.FAULTY]
        assert rows and all(r["ChargeDescription"].startswith("Faulty") and not r["SubAccountId"] for r in rows)
        # the quarantined card from 4 March 12:00 to the end of March: 660 card-hours at 2.00
        assert sum(Decimal(r["ConsumedQuantity"]) for r in rows) == 660
        assert {r["ListUnitPrice"] for r in rows} == {"2.000000"}
        for r in files["focus"]:  # every row, idle and faulty included: quantity x unit price = list cost
            assert abs(Decimal(r["PricingQuantity"]) * Decimal(r["ListUnitPrice"]) - Decimal(r["ListCost"])) < Decimal("0.01")
        assert sum(Decimal(r["BilledCost"]) for r in files["focus"]) == report.total_cost
    mine, files = build(org.people["alpha"]["admin"], rq_queues, django_capture_on_commit_callbacks,
                        tenant=org.tenants["alpha"], grouping=ReportGrouping.TENANT)
    assert {r["tenant"] for r in files["csv"][:-1]} == {"alpha"}  # a tenant's report: neither idle nor faulty
