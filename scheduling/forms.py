"""Forms of the scheduler's pages. The submit form narrows its choices to what the user may
use: projects they may submit in, specs active, priority classes allowed for the chosen
project's class and the user's role (the service checks all of it again)."""

from __future__ import annotations

import shlex

from django import forms
from django.urls import reverse

from scheduling import queries, services
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

    DEPENDENT = ("project", "spec", "replicas")  # a change re-renders the choices through htmx
    REFRESHED = ("project", "spec", "priority_class", "replicas")  # what that re-render replaces

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        self.user = user
        projects = access.visible_to(user, Project).filter(
            pk__in=access.project_ids(user, "submit_job"), archived__isnull=True, tenant__state="active"
        ).select_related("tenant")
        self.fields["project"].queryset = projects
        project = self._chosen(projects, "project")
        specs = services.allowed_specs(project)
        self.fields["spec"].queryset = specs
        # Every class validates here so that a class the project may not use reaches
        # services.submit_job, which refuses it with an audit event; only the allowed ones
        # are offered.
        self.fields["priority_class"].queryset = PriorityClass.objects.all()
        allowed = services.allowed_priority_classes(user, project) if project is not None else []
        self.allowed_priority_pks = {p.pk for p in allowed}
        self.fields["priority_class"].choices = [("", "Choose a priority class")] + [(p.pk, p.name) for p in allowed]
        self.chosen_project = project
        self.chosen_spec = self._chosen(specs, "spec")
        for name in self.DEPENDENT:
            self.fields[name].widget.attrs.update({
                "hx-post": reverse("scheduling:job_create"), "hx-target": "#job-form-dependent",
                "hx-select": "#job-form-dependent", "hx-swap": "outerHTML", "hx-include": "closest form",
                "hx-trigger": "change",
            })

    def _raw(self, name):
        return self.data.get(name) if self.is_bound else self.initial.get(name)

    def _chosen(self, queryset, name):
        raw = self._raw(name)
        if raw in (None, ""):
            return None
        try:
            return queryset.get(pk=int(getattr(raw, "pk", raw)))
        except (queryset.model.DoesNotExist, ValueError, TypeError):
            return None

    def quota_preview(self) -> list[dict]:
        """What the job would use of each quota line and what would be left."""
        try:
            replicas = int(self._raw("replicas") or 1)
        except (TypeError, ValueError):
            replicas = 1
        return queries.quota_preview(self.chosen_project, self.chosen_spec, replicas)

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
