"""Metering models by topic: the hourly ledger and prices, rollups, budgets, alarms, reports."""

from metering.models.alarms import Alarm, AlarmKind, AlarmSeverity
from metering.models.budgets import Budget, BudgetMode, BudgetUnit
from metering.models.ledger import Price, TokenPrice, TokenUsage, UsageRecord
from metering.models.reports import Report, ReportGrouping, ReportMode, ReportStatus
from metering.models.rollups import Granularity, PoolCapacity, UsageRollup

__all__ = [
    "Alarm", "AlarmKind", "AlarmSeverity", "Budget", "BudgetMode", "BudgetUnit", "Granularity", "PoolCapacity",
    "Price", "Report", "ReportGrouping", "ReportMode", "ReportStatus", "TokenPrice", "TokenUsage", "UsageRecord",
    "UsageRollup",
]
