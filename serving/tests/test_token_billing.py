"""The gateway's metered tokens reach the bill: metering's ledger, and the finance report built
from it, carry exactly what the upstream reported, however often the rollup runs."""

from __future__ import annotations

import datetime as dt

import pytest
from django.db.models import Sum
from django.utils import timezone

from metering import exports
from metering import services as metering
from metering.models import ReportGrouping, ReportMode
from metering.models import TokenUsage as Ledger
from serving.tests.conftest import bearer, chat_body

pytestmark = pytest.mark.django_db


def test_gateway_tokens_reach_the_ledger_once_and_the_finance_report(world, client):
    w = world
    for i in range(4):
        r = client.post("/v1/chat/completions", chat_body("word " * (i + 2)), content_type="application/json",
                        **bearer(w.secret["alpha"]))
        assert r.status_code == 200
    today = timezone.now().date()
    metering.rollup(today - dt.timedelta(days=1), today)
    metering.rollup(today - dt.timedelta(days=1), today)  # again: the ledger does not double
    ledger = Ledger.objects.filter(project=w.org.projects["alpha"]).aggregate(
        i=Sum("input_tokens"), o=Sum("output_tokens"), n=Sum("requests"))
    assert (ledger["i"], ledger["o"], ledger["n"]) == (w.up.stats.prompt_tokens, w.up.stats.completion_tokens, 4)
    assert not Ledger.objects.exclude(project=w.org.projects["alpha"]).exists()
    assert set(Ledger.objects.values_list("model_service", flat=True)) == {w.service["alpha"].slug}

    report = metering.request_report(w.org.finance, period_start=today.replace(day=1),
                                     period_end=today + dt.timedelta(days=1), grouping=ReportGrouping.MODEL_SERVICE,
                                     mode=ReportMode.SHOWBACK, enqueue=False)
    lines = exports.report_lines(report)
    assert sum(a.tokens_in for a in lines.atoms) == w.up.stats.prompt_tokens
    assert sum(a.tokens_out for a in lines.atoms) == w.up.stats.completion_tokens
