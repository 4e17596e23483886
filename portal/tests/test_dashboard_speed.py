"""What the dashboard's speed-ups must not change: the chart figures are exactly what plotly
builds, and /ping (the benchmarks' trivial signed-in page) is a real signed-in page."""

from __future__ import annotations

import json

from conftest import PASSWORD
from portal.dashboard import _figure


def test_figure_dict_is_what_plotly_graph_objects_builds():
    import plotly.graph_objects as go

    traces = [{"x": ["2026-01-01", "2026-01-02"], "y": [1.5, 0], "name": "L4"},
              {"x": ["2026-01-01", "2026-01-02"], "y": [2, 3.25], "name": "H100"}]
    for stacked in (True, False):
        ours = _figure(traces, title="Card-hours", y_title="card-hours", stacked=stacked)
        theirs = go.Figure(
            data=[go.Bar(**t) for t in traces],
            layout={"template": "none", "barmode": "stack" if stacked else "group", "height": 300,
                    "title": {"text": "Card-hours", "font": {"size": 15}},
                    "margin": {"l": 56, "r": 16, "t": 44, "b": 48}, "legend": {"orientation": "h", "y": -0.2},
                    "yaxis": {"title": {"text": "card-hours"}, "rangemode": "tozero"}, "xaxis": {"type": "date"}},
        ).to_plotly_json()
        assert json.dumps(ours, sort_keys=True) == json.dumps(theirs, sort_keys=True)


def test_ping_is_a_signed_in_page_with_the_navigation(client, org):
    assert client.get("/ping")["Location"].startswith("/login")
    user = org.people["alpha"]["user"]
    assert client.login(username=user.username, password=PASSWORD)
    html = client.get("/ping").content.decode()
    assert f"Signed in as {user.username}." in html
    assert 'href="/scheduling/jobs/"' in html  # the navigation for the user's roles is there
