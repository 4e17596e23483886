"""Forms of the serving pages. Choices are always narrowed to the acting user's reach; the
services re-check everything, so a forged choice fails there too."""

from __future__ import annotations

import datetime as dt

from django import forms
from django.utils import timezone

from scheduling.models import PriorityClass, ResourceSpec
from serving import services as svc
from serving.models import ModelService, Visibility
from tenants import access
from tenants.models import Project, Tenant


def _projects(user, perm):
    return Project.objects.filter(pk__in=access.project_ids(user, perm), archived__isnull=True).select_related("tenant")


class ModelServiceForm(forms.Form):
    project = forms.ModelChoiceField(queryset=Project.objects.none())
    slug = forms.SlugField(max_length=40, help_text='the "model" name clients send; unique in the tenant')
    name = forms.CharField(max_length=120)
    base_model = forms.CharField(max_length=120)
    model_version = forms.CharField(max_length=60, required=False)
    spec = forms.ModelChoiceField(queryset=ResourceSpec.objects.filter(active=True))
    priority_class = forms.ModelChoiceField(queryset=PriorityClass.objects.all())
    replicas = forms.IntegerField(min_value=1, max_value=16, initial=1)
    upstream_url = forms.URLField(max_length=300, assume_scheme="http")
    upstream_model = forms.CharField(max_length=200, required=False)
    visibility = forms.ChoiceField(choices=Visibility.choices)

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["project"].queryset = _projects(user, svc.USE_PERM)


class KnowledgeBaseForm(forms.Form):
    tenant = forms.ModelChoiceField(queryset=Tenant.objects.none())
    slug = forms.SlugField(max_length=40)
    name = forms.CharField(max_length=120)
    description = forms.CharField(max_length=300, required=False)
    all_projects = forms.BooleanField(required=False, label="Share with every project of the tenant")
    projects = forms.ModelMultipleChoiceField(queryset=Project.objects.none(), required=False)

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        tenants = access.tenant_ids(user, svc.KB_ADMIN_PERM)
        self.fields["tenant"].queryset = Tenant.objects.filter(pk__in=tenants)
        self.fields["projects"].queryset = Project.objects.filter(tenant__in=tenants, archived__isnull=True)


class UploadForm(forms.Form):
    # What the file really is is decided by serving.ingest from its bytes; `accept` only helps
    # the browser's file picker.
    file = forms.FileField(
        allow_empty_file=True,  # the service says "the file is empty", like every other refusal
        widget=forms.FileInput(attrs={"accept": ".txt,.text,.md,.markdown,.pdf,text/plain,"
                                                         "text/markdown,application/pdf"}),
    )


class SearchForm(forms.Form):
    q = forms.CharField(max_length=300, required=False, label="Search")


class ApplicationForm(forms.Form):
    project = forms.ModelChoiceField(queryset=Project.objects.none())
    slug = forms.SlugField(max_length=40)
    name = forms.CharField(max_length=120)
    service = forms.ModelChoiceField(queryset=ModelService.objects.none())
    knowledge_bases = forms.ModelMultipleChoiceField(queryset=svc.KnowledgeBase.objects.none(), required=False)
    system_prompt = forms.CharField(widget=forms.Textarea, required=False)
    top_k = forms.IntegerField(min_value=1, max_value=20, initial=4)

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["project"].queryset = _projects(user, svc.USE_PERM)
        self.fields["service"].queryset = svc.services_for_user(user)
        self.fields["knowledge_bases"].queryset = svc.kbs_for_user(user)


class ApiKeyForm(forms.Form):
    project = forms.ModelChoiceField(queryset=Project.objects.none())
    name = forms.CharField(max_length=80)
    services = forms.ModelMultipleChoiceField(queryset=ModelService.objects.none(), required=False)
    knowledge_bases = forms.ModelMultipleChoiceField(queryset=svc.KnowledgeBase.objects.none(), required=False)
    expires_in_days = forms.IntegerField(min_value=1, max_value=366, required=False,
                                         help_text="empty: no expiry (rotate regularly)")
    requests_per_minute = forms.IntegerField(min_value=1, required=False)
    tokens_per_minute = forms.IntegerField(min_value=1, required=False)

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["project"].queryset = _projects(user, svc.KEY_PERM)
        self.fields["services"].queryset = svc.services_for_user(user)
        self.fields["knowledge_bases"].queryset = svc.kbs_for_user(user)

    def expires(self):
        days = self.cleaned_data.get("expires_in_days")
        return timezone.now() + dt.timedelta(days=days) if days else None


class RotateForm(forms.Form):
    grace_hours = forms.IntegerField(min_value=0, max_value=720, initial=24)


class RevokeForm(forms.Form):
    reason = forms.CharField(max_length=300, required=False)
    confirm = forms.BooleanField()
