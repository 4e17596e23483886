"""Forms of the tenant console and the platform pages.

They only parse what a person typed; every choice they offer is already narrowed to what
the user may see (projects of this tenant, roles this user may hand out), and the services
check all of it again. A form never saves a model itself.
"""

from __future__ import annotations

import datetime as dt

from django import forms
from django.utils import timezone

from scheduling.models import Accelerator, Node
from tenants.models import Project, ProjectClass, TenantState
from tenants.roles import GRANTABLE_BY, PLATFORM_ROLES, PROJECT_ROLES, ROLES, TENANT_ROLES


def _role_choices(names) -> list[tuple[str, str]]:
    return [(n, ROLES[n].title) for n in names]


class MemberAddForm(forms.Form):
    who = forms.CharField(max_length=255, label="Username, e-mail or SSO subject")
    project = forms.ModelChoiceField(queryset=Project.objects.none(), required=False,
                                     empty_label="the whole tenant", label="Where")
    role = forms.ChoiceField(choices=_role_choices(TENANT_ROLES + PROJECT_ROLES))

    def __init__(self, *args, projects=None, **kwargs):
        super().__init__(*args, **kwargs)
        # never Project.objects.all(): the choices would name other tenants' projects
        self.fields["project"].queryset = projects if projects is not None else Project.objects.none()

    def clean(self):
        data = super().clean()
        role, project = data.get("role"), data.get("project")
        if role and project is None and role not in TENANT_ROLES:
            self.add_error("role", f"{ROLES[role].title} is a project role: choose a project.")
        if role and project is not None and role not in PROJECT_ROLES:
            self.add_error("role", f"{ROLES[role].title} is a tenant role: choose the whole tenant.")
        return data


class RoleChangeForm(forms.Form):
    role = forms.ChoiceField(choices=_role_choices(TENANT_ROLES + PROJECT_ROLES))


class ProjectForm(forms.Form):
    slug = forms.SlugField(max_length=40)
    name = forms.CharField(max_length=120)
    project_class = forms.ChoiceField(choices=ProjectClass.choices, label="Class")
    cost_centre = forms.CharField(max_length=40, required=False, label="Cost centre")


class QuotaSplitForm(forms.Form):
    """One project's share of one tenant quota line."""

    project = forms.ModelChoiceField(queryset=Project.objects.none(), empty_label="Choose a project")
    line = forms.ChoiceField(label="Quota line")
    guaranteed = forms.DecimalField(min_value=0, max_digits=12, decimal_places=3)
    limit = forms.DecimalField(min_value=0, max_digits=12, decimal_places=3)

    def __init__(self, *args, projects, lines, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["project"].queryset = projects
        self.lines = {str(q.pk): q for q in lines}
        self.fields["line"].choices = [(str(q.pk), line_label(q)) for q in lines]


class TenantQuotaForm(forms.Form):
    tenant = forms.ModelChoiceField(queryset=None, empty_label="Choose a tenant")
    resource = forms.ChoiceField()
    accelerator_model = forms.ModelChoiceField(queryset=None, required=False, empty_label="(not a GPU line)")
    guaranteed = forms.DecimalField(min_value=0, max_digits=12, decimal_places=3)
    limit = forms.DecimalField(min_value=0, max_digits=12, decimal_places=3)

    def __init__(self, *args, tenants, **kwargs):
        from scheduling.models import AcceleratorModel, QuotaResource

        super().__init__(*args, **kwargs)
        self.fields["tenant"].queryset = tenants
        self.fields["resource"].choices = QuotaResource.choices
        self.fields["accelerator_model"].queryset = AcceleratorModel.objects.all()


def line_label(quota) -> str:
    what = f"{quota.accelerator_model.short_name} " if quota.accelerator_model_id else ""
    return f"{what}{quota.get_resource_display()}"


class TenantForm(forms.Form):
    slug = forms.SlugField(max_length=40)
    name = forms.CharField(max_length=120)


class TenantStateForm(forms.Form):
    state = forms.ChoiceField(choices=TenantState.choices)


class PlatformRoleForm(forms.Form):
    who = forms.CharField(max_length=255, label="Username, e-mail or SSO subject")
    role = forms.ChoiceField(choices=_role_choices(GRANTABLE_BY["security_admin"]))


class WorkOrderForm(forms.Form):
    title = forms.CharField(max_length=200)
    reason = forms.CharField(widget=forms.Textarea(attrs={"rows": 3}))
    nodes = forms.ModelMultipleChoiceField(queryset=Node.objects.none(), required=False)
    accelerators = forms.ModelMultipleChoiceField(queryset=Accelerator.objects.none(), required=False,
                                                  label="Cards")

    def __init__(self, *args, nodes, cards, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["nodes"].queryset = nodes
        self.fields["accelerators"].queryset = cards


class VendorGrantForm(forms.Form):
    vendor = forms.CharField(max_length=255, label="Vendor account (username or e-mail)")
    starts = forms.DateTimeField(required=False, help_text="empty: now", widget=forms.DateTimeInput(
        attrs={"type": "datetime-local"}))
    hours = forms.IntegerField(min_value=1, max_value=24 * 14, initial=8, label="Hours of access")

    def clean(self):
        data = super().clean()
        starts = data.get("starts") or timezone.now()
        data["starts"] = starts
        if data.get("hours"):
            data["expires"] = starts + dt.timedelta(hours=data["hours"])
        return data


class RevokeForm(forms.Form):
    reason = forms.CharField(max_length=300, required=False)


PLATFORM_ROLE_CHOICES = _role_choices(PLATFORM_ROLES)
