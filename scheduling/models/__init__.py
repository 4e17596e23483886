"""Scheduling models, split by topic: inventory, requests (specs, priorities, quotas), jobs."""

from scheduling.models.inventory import (
    Accelerator,
    AcceleratorModel,
    Health,
    HealthEvent,
    HealthEventKind,
    Node,
    NodeState,
    ResourcePool,
    Vendor,
)
from scheduling.models.jobs import (
    ACTIVE_STATES,
    FINAL_STATES,
    Binding,
    BindingEnd,
    Job,
    JobEvent,
    JobKind,
    JobState,
    UtilisationSample,
    WaitReason,
)
from scheduling.models.requests import (
    ISOLATION,
    PriorityClass,
    Quota,
    QuotaResource,
    ResourceSpec,
    ShareMode,
)

__all__ = [
    "ACTIVE_STATES", "FINAL_STATES", "ISOLATION", "Accelerator", "AcceleratorModel", "Binding",
    "BindingEnd", "Health", "HealthEvent", "HealthEventKind", "Job", "JobEvent", "JobKind",
    "JobState", "Node", "NodeState", "PriorityClass", "Quota", "QuotaResource", "ResourcePool",
    "ResourceSpec", "ShareMode", "UtilisationSample", "Vendor", "WaitReason",
]
