"""Serving pages: model services (create, publish, retire, usage), applications, knowledge
bases (upload, documents, search) and API keys (create - shown once, rotate, revoke).

Thin views: every object comes from a reach-limited queryset (another tenant's object is a
404), changes go through serving.services. A key's secret is rendered exactly once, in the
response to the request that created it; it is never put in a redirect, message or session.
"""

from __future__ import annotations

import datetime as dt

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied, ValidationError
from django.db.models import Sum
from django.db.models.functions import TruncDay
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.csrf import csrf_exempt, csrf_protect
from django.views.decorators.http import require_http_methods, require_POST
from django_tables2 import RequestConfig

from portal.forms import add_service_errors
from portal.rendering import render_page
from serving import forms as f
from serving import ingest
from serving import services as svc
from serving.models import ApiKey, Application, TokenUsage
from serving.tables import ApiKeyTable, ApplicationTable, KnowledgeBaseTable, ModelServiceTable
from tenants import access


def _table(request, table, per_page=25):
    RequestConfig(request, paginate={"per_page": per_page}).configure(table)
    return table


# --- model services ---------------------------------------------------------------------


@login_required
def service_list(request):
    qs = svc.services_for_user(request.user).select_related("project__tenant")
    table = _table(request, ModelServiceTable(qs))
    return render_page(request, "serving/service_list.html",
                       {"table": table, "may_create": bool(access.project_ids(request.user, svc.USE_PERM))},
                       fragment="partials/table.html")


@login_required
def service_detail(request, pk: int):
    service = get_object_or_404(svc.services_for_user(request.user).select_related("project__tenant", "job", "spec"),
                                pk=pk)
    usage = (access.visible_to(request.user, TokenUsage).filter(service=service)
             .annotate(day=TruncDay("hour")).values("day")
             .annotate(requests=Sum("requests"), input=Sum("input_tokens"), output=Sum("output_tokens"))
             .order_by("-day")[:31])
    may_publish = access.can(request.user, svc.PUBLISH_PERM, service.project)
    return render(request, "serving/service_detail.html", {
        "service": service, "usage": usage, "may_publish": may_publish and service.project.is_active,
        "owned_here": service.project_id in access.project_ids(request.user, "view_project"),
    })


@login_required
@require_http_methods(["GET", "POST"])
def service_create(request):
    if not access.project_ids(request.user, svc.USE_PERM):
        raise PermissionDenied("You do not use model services in any project.")
    form = f.ModelServiceForm(request.POST or None, user=request.user)
    if request.method == "POST" and form.is_valid():
        try:
            service = svc.create_model_service(request.user, **form.cleaned_data)
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            messages.success(request, f"Model service {service.slug} created as a draft.")
            return redirect("serving:service_detail", pk=service.pk)
    return render(request, "serving/form.html", {"form": form, "title": "New model service"},
                  status=400 if request.method == "POST" else 200)


def _lifecycle(request, pk: int, action):
    service = get_object_or_404(svc.services_for_user(request.user), pk=pk)
    try:
        action(request.user, service)
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
    # a PermissionDenied (visible service, no right to publish or retire) answers 403, as everywhere
    return redirect("serving:service_detail", pk=service.pk)


@login_required
@require_POST
def service_publish(request, pk: int):
    return _lifecycle(request, pk, svc.publish_service)


@login_required
@require_POST
def service_retire(request, pk: int):
    return _lifecycle(request, pk, svc.retire_service)


# --- applications -----------------------------------------------------------------------


@login_required
def application_list(request):
    qs = access.visible_to(request.user, Application).select_related("project__tenant", "service")
    return render_page(request, "serving/application_list.html",
                       {"table": _table(request, ApplicationTable(qs)),
                        "may_create": bool(access.project_ids(request.user, svc.USE_PERM))},
                       fragment="partials/table.html")


@login_required
@require_http_methods(["GET", "POST"])
def application_create(request):
    if not access.project_ids(request.user, svc.USE_PERM):
        raise PermissionDenied("You do not use model services in any project.")
    form = f.ApplicationForm(request.POST or None, user=request.user)
    if request.method == "POST" and form.is_valid():
        try:
            app = svc.create_application(request.user, **form.cleaned_data)
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            messages.success(request, f"Application {app.slug} created: POST /v1/applications/{app.slug}/chat")
            return redirect("serving:application_list")
    return render(request, "serving/form.html", {"form": form, "title": "New application"},
                  status=400 if request.method == "POST" else 200)


# --- knowledge bases --------------------------------------------------------------------


@login_required
def kb_list(request):
    qs = svc.kbs_for_user(request.user).select_related("tenant")
    return render_page(request, "serving/kb_list.html",
                       {"table": _table(request, KnowledgeBaseTable(qs)),
                        "may_create": bool(access.tenant_ids(request.user, svc.KB_ADMIN_PERM))},
                       fragment="partials/table.html")


@login_required
@require_http_methods(["GET", "POST"])
def kb_create(request):
    if not access.tenant_ids(request.user, svc.KB_ADMIN_PERM):
        raise PermissionDenied("Only a tenant's admins create knowledge bases.")
    form = f.KnowledgeBaseForm(request.POST or None, user=request.user)
    if request.method == "POST" and form.is_valid():
        try:
            kb = svc.create_knowledge_base(request.user, **form.cleaned_data)
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            return redirect("serving:kb_detail", pk=kb.pk)
    return render(request, "serving/form.html", {"form": form, "title": "New knowledge base"},
                  status=400 if request.method == "POST" else 200)


def _kb_page(request, kb, upload, *, status: int = 200):
    search = f.SearchForm(request.GET or None)
    hits = None
    if search.is_valid() and search.cleaned_data["q"]:
        hits = svc.search_for_user(request.user, kb, search.cleaned_data["q"], top_k=10)
    context = {"kb": kb, "documents": kb.documents.select_related("uploaded_by")[:200], "search": search,
               "hits": hits, "upload": upload, "may_upload": svc.may_upload(request.user, kb),
               "max_mib": ingest.MAX_DOCUMENT_BYTES // (1024 * 1024)}
    return render_page(request, "serving/kb_detail.html", context, fragment="serving/partials/kb_hits.html",
                       status=status)


@login_required
def kb_detail(request, pk: int):
    kb = get_object_or_404(svc.kbs_for_user(request.user).select_related("tenant"), pk=pk)
    return _kb_page(request, kb, f.UploadForm())


@csrf_exempt  # only so the bounded upload handler is in place before the body is read; checked below
def kb_upload(request, pk: int):
    # Django's default handlers would spool any size of upload to memory or disk; this one keeps
    # MAX_DOCUMENT_BYTES + 1 bytes and drops the rest (serving/ingest.py). Then the same checks
    # in the same order as every other POST view: CSRF, sign-in, method.
    if request.method == "POST":
        request.upload_handlers = [ingest.BoundedUploadHandler(request)]
    return _kb_upload(request, pk)


@csrf_protect
@login_required
@require_POST
def _kb_upload(request, pk: int):
    kb = get_object_or_404(svc.kbs_for_user(request.user).select_related("tenant"), pk=pk)
    form = f.UploadForm(request.POST, request.FILES)
    if form.is_valid():
        upload = form.cleaned_data["file"]
        try:
            doc = svc.upload_document(request.user, kb, filename=upload.name,
                                      content_type=upload.content_type or "", data=upload)
        except ValidationError as exc:
            add_service_errors(form, exc)
        # a PermissionDenied (a base in reach to read, not to write) answers 403, as everywhere
        else:
            messages.success(request, f"{doc.title}: {doc.chunk_count} chunks indexed.")
            return redirect("serving:kb_detail", pk=kb.pk)
    # the page again, with the reason on the file field
    return _kb_page(request, kb, form, status=400)


# --- API keys ---------------------------------------------------------------------------


@login_required
def key_list(request):
    qs = access.visible_to(request.user, ApiKey).select_related("project__tenant", "created_by")
    return render_page(request, "serving/key_list.html",
                       {"table": _table(request, ApiKeyTable(qs)),
                        "may_create": bool(access.project_ids(request.user, svc.KEY_PERM))},
                       fragment="partials/table.html")


@login_required
def key_detail(request, pk: int):
    key = access.get_visible_or_404(request.user, ApiKey.objects.select_related("project__tenant", "created_by"),
                                    pk=pk)
    return render(request, "serving/key_detail.html", {
        "key": key, "services": key.services.all(), "kbs": key.knowledge_bases.all(),
        "rotate": f.RotateForm(), "revoke": f.RevokeForm(), "manage": access.can(request.user, svc.KEY_PERM, key.project),
    })


def _show_secret(request, key: ApiKey, secret: str, title: str):
    response = render(request, "serving/key_secret.html", {"key": key, "secret": secret, "title": title})
    response["Cache-Control"] = "no-store"
    return response


@login_required
@require_http_methods(["GET", "POST"])
def key_create(request):
    if not access.project_ids(request.user, svc.KEY_PERM):
        raise PermissionDenied("You may not manage API keys in any project.")
    form = f.ApiKeyForm(request.POST or None, user=request.user)
    if request.method == "POST" and form.is_valid():
        data = form.cleaned_data
        try:
            key, secret = svc.create_api_key(
                request.user, project=data["project"], name=data["name"], services=data["services"],
                knowledge_bases=data["knowledge_bases"], expires=form.expires(),
                requests_per_minute=data["requests_per_minute"], tokens_per_minute=data["tokens_per_minute"])
        except ValidationError as exc:
            add_service_errors(form, exc)
        else:
            return _show_secret(request, key, secret, "API key created")
    return render(request, "serving/form.html", {"form": form, "title": "New API key"},
                  status=400 if request.method == "POST" else 200)


@login_required
@require_POST
def key_rotate(request, pk: int):
    key = access.get_visible_or_404(request.user, ApiKey, pk=pk)
    form = f.RotateForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Give a grace period between 0 and 720 hours.")
        return redirect("serving:key_detail", pk=key.pk)
    try:
        new, secret = svc.rotate_api_key(request.user, key, grace=dt.timedelta(hours=form.cleaned_data["grace_hours"]))
    except ValidationError as exc:
        messages.error(request, " ".join(exc.messages))
        return redirect("serving:key_detail", pk=key.pk)
    return _show_secret(request, new, secret, "API key rotated")


@login_required
@require_POST
def key_revoke(request, pk: int):
    key = access.get_visible_or_404(request.user, ApiKey, pk=pk)
    form = f.RevokeForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Tick the confirmation box to revoke the key.")
    else:
        try:
            svc.revoke_api_key(request.user, key, reason=form.cleaned_data["reason"])
        except ValidationError as exc:
            messages.error(request, " ".join(exc.messages))
        else:
            messages.success(request, f"Key {key.prefix}… revoked; it stops at its next request.")
    return redirect("serving:key_detail", pk=key.pk)
