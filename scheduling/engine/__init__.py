"""Atrium's scheduling engine: plain Python over dataclasses, no Django import.

It takes a snapshot of the fleet, quotas and pending jobs and returns decisions; it never
touches the database, the cluster or the clock on its own, so it can be tested, benchmarked
and replayed on traces alone. Nothing in this package may import django or any Atrium app.
"""
