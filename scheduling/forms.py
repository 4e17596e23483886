"""Forms of the scheduler's pages. The submit form narrows its choices to what the user may
use: projects they may submit in, specs active, priority classes allowed for the chosen
project's class and the user's role (the service checks all of it again)."""

from __future__ import annotations

import shlex

from django import forms

from scheduling import services
from scheduling.models import Health, PriorityClass, ResourceSpec
from tenants import access
from tenants.models import Project


class JobForm(forms.Form):
    project = forms.ModelChoiceField(queryset=Project.objects.none(), empty_label="Choose a project")
    spec = forms.ModelChoiceField(queryset=ResourceSpec.objects.none(), label="Resource spec",
                                  empty_label="Choose a resource spec")
    priority_class = forms.ModelChoiceField(queryset=PriorityClass.objects.none(), label="Priority class",
                                            empty_label="Choose a priority class")
    name = forms.CharField(max_length=120)
    image = forms.CharField(max_length=300, initial="nvcr.io/nvidia/pytorch:24.10-py3")
    command = forms.CharField(max_length=2000, help_text="as you would type it in a shell")
    replicas = forms.IntegerField(min_value=1, max_value=64, initial=1,
                                  help_text="nodes for a multi-node job (all or nothing)")
    expected_minutes = forms.IntegerField(min_value=1, max_value=60 * 24 * 14, initial=60,
                                          label="Expected run time (minutes)")
    time_limit_minutes = forms.IntegerField(min_value=1, max_value=60 * 24 * 14, initial=24 * 60,
                                            label="Time limit (minutes)")

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        self.user = user
        projects = access.visible_to(user, Project).filter(
            pk__in=access.project_ids(user, "submit_job"), archived__isnull=True, tenant__state="active"
        ).select_related("tenant")
        self.fields["project"].queryset = projects
        self.fields["spec"].queryset = ResourceSpec.objects.filter(active=True)
        project = self._chosen_project(projects)
        if project is not None:
            allowed = services.allowed_priority_classes(user, project)
            self.fields["priority_class"].queryset = PriorityClass.objects.filter(pk__in=[p.pk for p in allowed])
        self.project = project

    def _chosen_project(self, projects):
        raw = self.data.get("project") if self.is_bound else self.initial.get("project")
        if raw in (None, ""):
            return None
        try:
            return projects.get(pk=int(getattr(raw, "pk", raw)))
        except (Project.DoesNotExist, ValueError, TypeError):
            return None

    def clean_command(self):
        try:
            parts = shlex.split(self.cleaned_data["command"])
        except ValueError as exc:
            raise forms.ValidationError(f"The command cannot be parsed: {exc}.") from exc
        if not parts:
            raise forms.ValidationError("Give the command to run.")
        return parts

    def clean(self):
        data = super().clean()
        spec, replicas = data.get("spec"), data.get("replicas")
        if spec and replicas and replicas > 1 and spec.mode != "whole":
            self.add_error("replicas", "Multi-node jobs use whole-card specs.")
        if data.get("expected_minutes") and data.get("time_limit_minutes") and (
            data["expected_minutes"] > data["time_limit_minutes"]
        ):
            self.add_error("expected_minutes", "The expected run time is longer than the time limit.")
        return data


class CardHealthForm(forms.Form):
    health = forms.ChoiceField(choices=[(Health.QUARANTINED, "quarantine"), (Health.HEALTHY, "release")])
    reason = forms.CharField(max_length=300)


class CancelForm(forms.Form):
    reason = forms.CharField(max_length=300, required=False)
    confirm = forms.BooleanField(required=True, error_messages={"required": "Tick the box to confirm."})
