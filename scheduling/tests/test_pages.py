"""The scheduler's pages: submit (dependent fields through htmx, the quota the job would use,
field errors, a refused priority class audited once), job list filters, job detail with its
wait reason and bindings, cancel only by POST with confirmation, and a fixed query budget per
page that does not grow with the number of rows."""

from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from conftest import PASSWORD
from portal.models import AuditEvent
from scheduling import cycle, services
from scheduling.models import Binding, Job, JobState

HX = {"HTTP_HX_REQUEST": "true"}


@pytest.fixture(autouse=True)
def fast_passwords(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def login(client, user):
    assert client.login(username=user.get_username(), password=PASSWORD)
    return client


def options(html: str, name: str) -> list[str]:
    select = re.search(rf'<select name="{name}"[^>]*>(.*?)</select>', html, re.S)
    assert select, f"no select {name}"
    return [label.strip() for value, label in re.findall(r'<option value="([^"]*)"[^>]*>([^<]*)</option>', select[1])
            if value]


def form_data(org, slug, **over):
    data = {"project": org.projects[slug].pk, "spec": org.specs["h1"].pk, "priority_class": org.prio["batch"].pk,
            "name": "train-1", "image": "img:1", "command": "python train.py --epochs 3", "replicas": 1,
            "expected_minutes": 60, "time_limit_minutes": 120}
    data.update(over)
    return data


def submit(org, slug, name="j", prio="batch", spec="h1"):
    return services.submit_job(org.people[slug]["user"], project=org.projects[slug], spec=org.specs[spec],
                               priority_class=org.prio[prio], name=name, image="img:1", command=["run"])


def count_queries(client, url) -> int:
    client.get(url)  # warm: per-process caches (content types, ...) are not the page's cost
    with CaptureQueriesContext(connection) as ctx:
        response = client.get(url)
    assert response.status_code == 200
    return len(ctx.captured_queries)


# --- submit ------------------------------------------------------------------------------


@pytest.mark.django_db
def test_submit_form_rerenders_specs_classes_and_quota_for_the_chosen_project(client, org):
    # alpha's project gets no L4 any more: the L4 spec is not offered there
    services.set_quota(org.admin, tenant=org.tenants["alpha"], project=org.projects["alpha"], resource="gpus",
                       accelerator_model=org.models["l4"], guaranteed=0, limit=0)
    (running,) = [submit(org, "alpha", "already-running")]
    cycle.run_cycle()
    assert Job.objects.get(pk=running.pk).state == JobState.ADMITTED
    url = reverse("scheduling:job_create")

    login(client, org.people["alpha"]["user"])
    page = client.get(url).content.decode()
    assert 'hx-post="/' in page and 'id="job-form-fields"' in page
    r = client.post(url, {"project": org.projects["alpha"].pk, "spec": org.specs["h1"].pk, "replicas": 2}, **HX)
    assert r.status_code == 200
    html = r.content.decode()
    assert "<html" not in html and html.lstrip().startswith('<div id="job-form-fields"')
    assert options(html, "priority_class") == ["training", "batch"]  # research project: no production
    assert options(html, "spec") == ["h100 x1", "h100 x4"]
    # the quota it would use: 1 of 4 H100 in use, the job adds 2, 1 left, on project and tenant
    rows = re.findall(r'<tr class="[^"]*" data-quota="([^"]+)">\s*<td>[^<]*</td><td>([^<]*)</td><td>([^<]*)</td>'
                      r'<td>([^<]*)</td><td>([^<]*)</td>\s*<td>([^<]*)', html)
    assert [(q, m, used, need, left) for q, m, used, need, _lim, left in rows] == [
        ("project alpha-p", "H100", "1", "2", "1 (borrowed: may be preempted)"),
        ("tenant alpha", "H100", "1", "2", "1 (borrowed: may be preempted)"),
    ]
    client.logout()

    login(client, org.people["beta"]["user"])
    html = client.post(url, {"project": org.projects["beta"].pk, "spec": org.specs["h4"].pk, "replicas": 2},
                       **HX).content.decode()
    assert options(html, "priority_class") == ["production", "training", "batch"]
    assert options(html, "spec") == ["h100 x1", "h100 x4", "l4 x0.5"]
    assert "over by 4: the job would wait for quota" in html
    assert not Job.objects.filter(project=org.projects["beta"]).exists()  # re-rendering saves nothing


@pytest.mark.django_db
def test_valid_submission_stores_a_pending_job_and_redirects(client, org):
    login(client, org.people["alpha"]["user"])
    r = client.post(reverse("scheduling:job_create"), form_data(org, "alpha"))
    job = Job.objects.get()
    assert r.status_code == 302 and r["Location"] == reverse("scheduling:job_detail", args=[job.pk])
    assert job.state == JobState.PENDING and job.command == ["python", "train.py", "--epochs", "3"]
    assert AuditEvent.objects.filter(action="job.submit", outcome="success").count() == 1


@pytest.mark.django_db
def test_a_priority_class_not_allowed_for_the_project_is_refused_on_the_field_and_audited_once(client, org):
    login(client, org.people["alpha"]["user"])
    r = client.post(reverse("scheduling:job_create"), form_data(org, "alpha", priority_class=org.prio["production"].pk))
    assert r.status_code == 400
    form = r.context["form"]
    assert "priority_class" in form.errors and "production" in form.errors["priority_class"][0]
    assert not Job.objects.exists()
    denied = AuditEvent.objects.filter(action="job.submit", outcome="denied")
    assert denied.count() == 1 and "production" in denied.get().reason


@pytest.mark.django_db
def test_invalid_input_gives_field_errors_status_400_and_saves_nothing(client, org):
    login(client, org.people["alpha"]["user"])
    before = AuditEvent.objects.count()
    r = client.post(reverse("scheduling:job_create"), form_data(
        org, "alpha", name="", command="python 'unbalanced", expected_minutes=500, time_limit_minutes=60,
        spec=org.specs["l4half"].pk, replicas=2))
    assert r.status_code == 400
    errors = r.context["form"].errors
    assert set(errors) >= {"name", "command", "expected_minutes", "replicas"}
    html = r.content.decode()
    assert 'class="field has-error"' in html and "cannot be parsed" in html
    assert not Job.objects.exists() and AuditEvent.objects.count() == before


# --- lists, detail, cancel -----------------------------------------------------------------


@pytest.mark.django_db
def test_job_list_filters_and_never_shows_another_tenants_jobs(client, org):
    a1, a2 = submit(org, "alpha", "alpha-train"), submit(org, "alpha", "alpha-eval")
    b1 = submit(org, "beta", "beta-secret")
    services.cancel_job(org.people["alpha"]["user"], a2)
    login(client, org.people["alpha"]["user"])
    url = reverse("scheduling:job_list")

    def names(params):
        html = client.get(url, params).content.decode()
        return sorted(set(re.findall(r">(alpha-\w+|beta-\w+)</a>", html)))

    assert names({}) == ["alpha-eval", "alpha-train"]
    assert names({"state": "pending"}) == ["alpha-train"]
    assert names({"state": "cancelled"}) == ["alpha-eval"]
    assert names({"q": "eval"}) == ["alpha-eval"]
    assert names({"project": org.projects["alpha"].pk, "mine": "true"}) == ["alpha-eval", "alpha-train"]
    assert "beta-secret" not in client.get(url, {"q": "secret"}).content.decode()
    assert client.get(reverse("scheduling:job_detail", args=[b1.pk])).status_code == 404
    assert a1.pk != b1.pk


@pytest.mark.django_db
def test_job_list_polls_only_while_a_row_on_it_can_change(client, org):
    job = submit(org, "alpha", "will-finish")
    login(client, org.people["alpha"]["user"])
    url = reverse("scheduling:job_list")
    poll = {"HTTP_HX_REQUEST": "true", "HTTP_HX_TRIGGER": "job-list-poll"}
    assert 'hx-trigger="every 10s"' in client.get(url).content.decode()
    assert client.get(url, **poll).status_code == 200
    services.cancel_job(org.people["alpha"]["user"], job)
    assert "hx-trigger" not in client.get(url).content.decode().split('id="job-list-poll"')[1].split(">")[0]
    r = client.get(url, **poll)
    assert r.status_code == 286 and "will-finish" in r.content.decode()  # the last swap, then no more polls
    # a filter change (the form is not the poller) swaps as usual even when nothing is live
    assert client.get(url, {"state": "cancelled"}, HTTP_HX_REQUEST="true").status_code == 200


@pytest.mark.django_db
def test_job_table_written_out_renders_the_same_cells_as_django_tables2(rf, org):
    from django_tables2 import RequestConfig

    from scheduling.tables import JobTable

    jobs = [submit(org, "alpha", f"cell-{i}") for i in range(6)]
    cycle.run_cycle()  # some admitted, some waiting with a reason and a position
    services.cancel_job(org.people["alpha"]["user"], jobs[0])
    request = rf.get("/scheduling/jobs/")
    request.user = org.admin

    def cells(template):
        table = JobTable(Job.objects.select_related("project__tenant", "spec", "priority_class"))
        RequestConfig(request, paginate={"per_page": 25}).configure(table)
        table.template_name = template
        body = table.as_html(request).split("<tbody")[1].split("</tbody>")[0]
        return [re.sub(r"\s+", " ", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", body, re.S)]

    written, generic = cells("scheduling/partials/job_table.html"), cells("django_tables2/table.html")
    assert len(generic) == 9 * 6
    assert written == generic
    assert any(c.startswith("project alpha-p") or "quota" in c for c in written)  # a wait reason is among them


@pytest.mark.django_db
def test_job_detail_shows_the_wait_reason_and_the_bindings(client, org):
    jobs = [submit(org, "alpha", f"j{i}") for i in range(5)]
    cycle.run_cycle()
    login(client, org.people["alpha"]["user"])
    waiting = Job.objects.get(pk__in=[j.pk for j in jobs], state=JobState.PENDING)
    html = client.get(reverse("scheduling:job_detail", args=[waiting.pk])).content.decode()
    assert "project alpha-p: 4 of 4" in html and "(position 1 in the queue)" in html
    running = Job.objects.filter(pk__in=[j.pk for j in jobs], state=JobState.ADMITTED).first()
    binding = Binding.objects.get(job=running)
    html = client.get(reverse("scheduling:job_detail", args=[running.pk])).content.decode()
    assert f"<td>{binding.accelerator}</td><td>H100</td><td>whole</td>" in html
    assert "No card yet." in client.get(reverse("scheduling:job_detail", args=[waiting.pk])).content.decode()


@pytest.mark.django_db
def test_cancel_needs_post_and_the_confirmation_box(client, org):
    job = submit(org, "alpha", "to-cancel")
    login(client, org.people["alpha"]["user"])
    url = reverse("scheduling:job_cancel", args=[job.pk])
    assert client.get(url).status_code == 405
    r = client.post(url, {"reason": "oops"})  # no confirmation
    assert r.status_code == 302
    assert Job.objects.get(pk=job.pk).state == JobState.PENDING
    assert not AuditEvent.objects.filter(action="job.cancel").exists()
    client.post(url, {"reason": "oops", "confirm": "yes"})
    assert Job.objects.get(pk=job.pk).state == JobState.CANCELLED
    assert AuditEvent.objects.filter(action="job.cancel", target_id=str(job.pk)).count() == 1
    # another tenant's user cannot even find it
    client.logout()
    login(client, org.people["beta"]["admin"])
    assert client.post(url, {"confirm": "yes"}).status_code == 404


# --- query budgets -----------------------------------------------------------------------


def _more_work(org, n):
    for i in range(n):
        submit(org, "alpha", f"more-{i}")
        submit(org, "beta", f"more-b{i}", spec="l4half")
    cycle.run_cycle()


def _more_nodes(org, n):
    for i in range(n):
        services.register_node(org.ops, pool=org.nodes[0].pool, name=f"extra-{i}", cpu_milli=64_000,
                               memory_mib=256 * 1024, model=org.models["h100"], cards=4)


@pytest.mark.django_db
def test_job_list_and_detail_have_a_fixed_query_budget(client, org, django_assert_max_num_queries):
    _more_work(org, 2)
    login(client, org.admin)
    list_url = reverse("scheduling:job_list")
    small = count_queries(client, list_url)
    job = Job.objects.filter(state=JobState.ADMITTED).first()
    detail_url = reverse("scheduling:job_detail", args=[job.pk])
    small_detail = count_queries(client, detail_url)
    _more_work(org, 6)
    assert count_queries(client, list_url) == small
    assert count_queries(client, detail_url) == small_detail
    # the budget: session, user and role look-ups of the layout, then the page's own few
    with django_assert_max_num_queries(11):
        client.get(list_url)
    with django_assert_max_num_queries(12):
        client.get(detail_url)


@pytest.mark.django_db
def test_node_list_and_detail_have_a_fixed_query_budget(client, org, django_assert_max_num_queries):
    _more_work(org, 4)  # occupants on the cards
    h0 = org.nodes[0]
    services.record_health_event(org.ops, h0.accelerators.get(index=3), kind="thermal", message="hot")
    login(client, org.ops)
    list_url = reverse("scheduling:node_list")
    detail_url = reverse("scheduling:node_detail", args=[h0.pk])
    small, small_detail = count_queries(client, list_url), count_queries(client, detail_url)
    _more_nodes(org, 5)
    for card in h0.accelerators.all()[:2]:
        services.record_health_event(org.ops, card, kind="xid", code=13, message="XID 13")
    assert count_queries(client, list_url) == small
    assert count_queries(client, detail_url) == small_detail
    html = client.get(detail_url).content.decode()
    assert "alpha/alpha-p (job" in html  # ops see the occupant
    with django_assert_max_num_queries(16):
        client.get(list_url)
    with django_assert_max_num_queries(17):
        client.get(detail_url)
