"""Report lines priced in SQL: a price change inside the period, tokens priced by the hour
without a query per ledger row, and a FOCUS file that is exactly what the csv module writes."""

from __future__ import annotations

import csv
import datetime as dt
import io
from decimal import Decimal

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from metering import exports, services
from metering.models import Granularity, Price, ReportGrouping, ReportMode, TokenPrice, TokenUsage, UsageRollup
from metering.tests.conftest import t

pytestmark = pytest.mark.django_db

MARCH, APRIL = dt.date(2025, 3, 1), dt.date(2025, 4, 1)


def request(actor, **kw):
    kw = {"period_start": MARCH, "period_end": APRIL, "grouping": ReportGrouping.PROJECT,
          "mode": ReportMode.SHOWBACK, "enqueue": False, **kw}
    return services.request_report(actor, **kw)


@pytest.fixture
def tokens(org):
    """Tokens of two served models in alpha's project: m1's price changes on 15 March, m2's does not."""
    TokenPrice.objects.create(model_name="m1", per_million_input=Decimal("0.5"), per_million_output=Decimal("1.5"),
                              effective_from=t(2020, 1, 1))
    TokenPrice.objects.create(model_name="m1", per_million_input=Decimal("1"), per_million_output=Decimal("3"),
                              effective_from=t(2025, 3, 15))
    TokenPrice.objects.create(model_name="m2", per_million_input=Decimal("0.25"), per_million_output=Decimal("0.75"),
                              effective_from=t(2020, 1, 1))
    project = org.projects["alpha"]
    rows = []
    for i in range(60):  # every 12 hours over 30 days, for two services
        hour = t(2025, 3, 1) + dt.timedelta(hours=12 * i)
        for service, model in (('chat, "v2"', "m1"), ("code", "m2")):
            rows.append(TokenUsage(hour=hour, tenant=project.tenant, project=project, api_key="k", model_service=service,
                                   model_name=model, input_tokens=1_000_003 * (i + 1), output_tokens=77_777 * (i + 1),
                                   requests=1))
    TokenUsage.objects.bulk_create(rows)
    return rows


def expected_token_cost(rows) -> Decimal:
    total = Decimal(0)
    price_at = services.token_prices()
    for r in rows:
        pin, pout = price_at(r.model_name, r.hour)
        total += (pin * r.input_tokens + pout * r.output_tokens) / 1_000_000
    return total


def test_a_price_change_inside_the_period_prices_each_hour_and_leaves_other_models_alone(org, bind, prices):
    # H100 goes from 2.00 to 3.00 on 10 March; L4 stays at 0.50 all month
    Price.objects.create(accelerator_model=org.models["h100"], per_card_hour=Decimal("3"), effective_from=t(2025, 3, 10))
    l4 = org.nodes[2].accelerators.order_by("pk").first()
    bind("alpha", t(2025, 3, 9, 22), t(2025, 3, 10, 2))  # 2 h at 2.00 + 2 h at 3.00
    bind("alpha", t(2025, 3, 12, 0), t(2025, 3, 12, 4), card=l4, share_milli=500)  # 2 card-hours at 0.50
    services.rollup(MARCH, APRIL - dt.timedelta(days=1), now=t(2025, 4, 2))
    for grouping in (ReportGrouping.PROJECT, ReportGrouping.DAY, ReportGrouping.ACCELERATOR_MODEL):
        report = request(org.people["alpha"]["admin"], tenant=org.tenants["alpha"], grouping=grouping)
        lines = exports.report_lines(report)
        assert lines.total_cost == Decimal("11.000000"), grouping
        assert lines.total_card_hours == Decimal("6.000000")
        by_model = {a.accelerator_model_id: a.list_cost for a in lines.atoms if a.day is None}
        if grouping != ReportGrouping.DAY:
            assert by_model == {org.models["h100"].pk: Decimal("10.000000"), org.models["l4"].pk: Decimal("1.000000")}
    rolled = UsageRollup.objects.filter(granularity=Granularity.MONTH, tenant=org.tenants["alpha"])
    assert sum(r.cost for r in rolled) == Decimal("11.000000")  # the report and the rollups agree


def queries_of(report) -> tuple[int, exports.Lines]:
    with CaptureQueriesContext(connection) as ctx:
        lines = exports.report_lines(report)
    return len(ctx.captured_queries), lines


def test_tokens_are_priced_by_the_hour_with_a_fixed_number_of_queries(org, tokens):
    for grouping in (ReportGrouping.MODEL_SERVICE, ReportGrouping.DAY):
        report = request(org.finance, grouping=grouping)
        n, lines = queries_of(report)
        assert n < 30  # a query per token row would be 120 more
        token_cost = sum(a.list_cost for a in lines.atoms if a.accelerator_model_id is None)
        pieces = sum(1 for a in lines.atoms if a.accelerator_model_id is None) * 2  # priced pieces, rounded once each
        assert abs(token_cost - expected_token_cost(tokens)) <= Decimal("0.000001") * pieces
        assert sum(a.tokens_in for a in lines.atoms) == sum(r.input_tokens for r in tokens)
        assert lines.total_cost == sum(r["cost"] for r in lines.rows)
    project = org.projects["alpha"]  # twice the rows, in hours between the others: not one query more
    TokenUsage.objects.bulk_create([
        TokenUsage(hour=r.hour + dt.timedelta(hours=6), tenant=project.tenant, project=project, api_key="k",
                   model_service=r.model_service, model_name=r.model_name, input_tokens=5, output_tokens=7, requests=1)
        for r in tokens])
    assert queries_of(request(org.finance, grouping=ReportGrouping.DAY))[0] == n


def test_focus_file_is_byte_for_byte_what_the_csv_module_writes(org, bind, prices, tokens):
    bind("beta", t(2025, 3, 5, 0), t(2025, 3, 6, 0))
    services.rollup(MARCH, APRIL - dt.timedelta(days=1), now=t(2025, 4, 2))
    for grouping, mode in ((ReportGrouping.DAY, ReportMode.SHOWBACK), (ReportGrouping.TENANT, ReportMode.CHARGEBACK)):
        report = request(org.finance, grouping=grouping, mode=mode)
        lines = exports.report_lines(report)
        by_csv = io.StringIO()
        writer = csv.DictWriter(by_csv, exports.FOCUS_NAMES)
        writer.writeheader()
        writer.writerows(exports.focus_rows(report, lines))
        ours = exports.to_focus(report, lines)
        assert ours == by_csv.getvalue()
        rows = list(csv.DictReader(io.StringIO(ours)))
        assert {r["x_ModelService"] for r in rows} >= {'chat, "v2"', "code"}  # quoted fields survive
        assert sum(Decimal(r["BilledCost"]) for r in rows) == lines.total_cost
