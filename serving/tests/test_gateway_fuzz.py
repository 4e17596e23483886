"""The OpenAI-compatible gateway fed generated requests with hypothesis, against the real
upstream on loopback: every endpoint, JSON of any shape in the known fields (wrong types,
absurd numbers, NUL and right-to-left text, deep nesting), raw bytes, wrong content types,
good, malformed and missing keys.

Assertions for every request:
* never a 500 (the upstream injects no failure here, so no 502/504 either);
* a refusal (4xx) is an error object in OpenAI's shape, reaches no upstream and meters nothing;
* a success is metered at most once, with exactly the tokens the upstream reported.

`make test` runs a small derandomized budget; `make fuzz` (the "fuzz" hypothesis profile,
conftest.py) runs many more, randomized.
"""

from __future__ import annotations

import json

import pytest
from django.db.models import Sum
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from serving import ratelimit
from serving.models import GatewayRequest, TokenUsage
from serving.tests.conftest import bearer

FUZZING = hsettings.get_current_profile_name() == "fuzz"
EXAMPLES = max(40, hsettings.default.max_examples) if FUZZING else 40

NASTY_TEXT = ["", " ", "\x00", "a\x00b", "\u202egnp.exe", "🙂" * 50, "x" * 5000, "[[", "null", "<script>"]
# strings never carry the upstream's fault markers ("[[fail:500]]"): a failure here is the gateway's
TEXT = (st.text(max_size=200) | st.sampled_from(NASTY_TEXT)).map(lambda s: s.replace("[[", "[ ["))
NUMBERS = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
                    st.sampled_from([0, 1, -1, 2**31, 2**63, 10**30]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
                    max_leaves=20)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | TEXT,
                                 "content": TEXT | JSON})
FIELDS = {
    "model": st.sampled_from(["chat", "other", ""]) | JSON,
    "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "prompt": TEXT | st.lists(TEXT, max_size=3) | JSON,
    "input": TEXT | st.lists(TEXT, max_size=3) | JSON,
    "max_tokens": NUMBERS | JSON,
    "max_completion_tokens": NUMBERS | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | JSON}) | JSON,
    "temperature": NUMBERS | JSON,
    "query": TEXT | JSON,
    "top_k": NUMBERS | JSON,
    "n": NUMBERS,
}
BODY_JSON = st.fixed_dictionaries({}, optional=FIELDS).map(json.dumps)
RAW_BODIES = st.one_of(
    BODY_JSON,
    JSON.map(json.dumps),
    st.binary(max_size=300).map(lambda b: b.decode("latin-1")),
    st.sampled_from(['{"model": "chat", "messages": [' + "[" * 3000 + "]" * 3000 + "]}", '{"a": NaN}',
                     '{"max_tokens": 1e999}', "{", "", "null", '{"model": "chat"' + ", " * 10 + "}"]),
)
HELLO = [{"role": "user", "content": "hello there"}]
VALID = {
    "/v1/chat/completions": {"model": "chat", "messages": HELLO},
    "/v1/completions": {"model": "chat", "prompt": "hello there"},
    "/v1/embeddings": {"model": "chat", "input": ["hello", "there"]},
    "/v1/applications/helpdesk/chat": {"messages": HELLO},
    "search": {"query": "zorblax procedure", "top_k": 3},
}


@st.composite
def near_valid(draw, path: str) -> str:
    """The valid body of `path` with up to two fields replaced, added or dropped."""
    body = dict(VALID["search"] if "knowledge_bases" in path else VALID.get(path, {}))
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=2, unique=True)):
        if name in body and draw(st.booleans()):
            del body[name]
        else:
            body[name] = draw(FIELDS[name])
    return json.dumps(body)


CONTENT_TYPES = st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain",
                                 "application/x-www-form-urlencoded", "multipart/form-data", "", "application/JSON"])
METERED = {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/applications/helpdesk/chat"}


def metered() -> tuple[int, int, int]:
    agg = TokenUsage.objects.aggregate(i=Sum("input_tokens"), o=Sum("output_tokens"), r=Sum("requests"))
    return agg["i"] or 0, agg["o"] or 0, GatewayRequest.objects.count()


@pytest.mark.slow
def test_generated_requests_are_answered_in_openai_shape_and_metered_only_on_success(world, client):
    w = world
    paths = sorted(METERED) + [f"/v1/knowledge_bases/{w.kb['alpha'].pk}/search", "/v1/models"]
    good = bearer(w.secret["alpha"])
    keys = st.just(good) | st.sampled_from([good, bearer(w.secret["beta"]), bearer(w.q_secret), {},
                            {"HTTP_AUTHORIZATION": "Bearer atr_" + "A" * 40}, {"HTTP_AUTHORIZATION": "Basic eA=="},
                            {"HTTP_AUTHORIZATION": "Bearer " + w.secret["alpha"] + "\x00"}])
    seen: dict[str, set[int]] = {}

    @hsettings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=not FUZZING,
               suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(paths), key=keys, data=st.data(),
           content_type=st.just("application/json") | CONTENT_TYPES)
    def request(path, key, data, content_type):
        method = "GET" if path == "/v1/models" else "POST"
        method = data.draw(st.just(method) | st.sampled_from(["GET", "PUT", "DELETE"]), label="method")
        body = data.draw(near_valid(path) | RAW_BODIES, label="body")
        ratelimit.clear()  # each example starts with fresh windows; the limits have their own tests
        before, calls = metered(), (w.up.stats.requests, w.up.stats.prompt_tokens, w.up.stats.completion_tokens)
        response = client.generic(method, path, body.encode("utf-8", "surrogatepass"), content_type=content_type,
                                  **key)
        raw = b"".join(response.streaming_content) if response.streaming else response.content
        status = response.status_code
        seen.setdefault(path, set()).add(status)
        where = f"{method} {path} {content_type!r} {body[:300]!r} -> {status} {raw[:300]!r}"
        assert status < 500, where
        after = metered()
        if status >= 400:
            error = json.loads(raw)["error"]
            assert isinstance(error["message"], str) and error["message"] and error["type"], where
            assert after == before, where
            assert (w.up.stats.requests, w.up.stats.prompt_tokens, w.up.stats.completion_tokens) == calls, where
        else:
            assert after[2] - before[2] <= (1 if path in METERED else 0), where
            reported = (w.up.stats.prompt_tokens - calls[1], w.up.stats.completion_tokens - calls[2])
            assert (after[0] - before[0], after[1] - before[1]) in (reported, (0, 0)), where

    request()
    # the generator reached past authentication into validation and through to the upstream
    statuses = set().union(*seen.values())
    assert 200 in statuses and 400 in statuses and 401 in statuses, seen
