"""Knowledge-base and service isolation: with the same distinctive word in both tenants'
documents, every search path (service, page, API, application chat) of one tenant returns
only its own chunks, and another tenant's ids answer 404."""

from __future__ import annotations

import json

import pytest
from django.core.exceptions import PermissionDenied, ValidationError

from conftest import PASSWORD
from serving import services as svc
from serving.models import Chunk
from serving.tests.conftest import WORD, bearer


def test_same_word_in_both_tenants_is_indexed_for_both(world):
    assert Chunk.objects.filter(tenant=world.org.tenants["alpha"], text__icontains=WORD).exists()
    assert Chunk.objects.filter(tenant=world.org.tenants["beta"], text__icontains=WORD).exists()


def test_search_service_returns_only_the_given_tenants_chunks(world):
    w = world
    hits = svc.search_chunks(tenant_id=w.org.tenants["alpha"].pk, kb_ids=[w.kb["alpha"].pk, w.kb["beta"].pk],
                             query=WORD, top_k=20)
    assert hits and all("alphasecret" in h.text for h in hits)
    assert not any("betasecret" in h.text for h in hits)


def test_search_ranks_the_matching_chunk_first(world):
    w = world
    extra = f"Nothing here. {WORD} {WORD} {WORD} approval approval." + " filler" * 300
    svc.upload_document(w.org.people["alpha"]["user"], w.kb["alpha"], filename="rank.txt", content_type="text/plain",
                        data=extra.encode())
    hits = svc.search_chunks(tenant_id=w.org.tenants["alpha"].pk, kb_ids=[w.kb["alpha"].pk],
                             query=f"{WORD} approval", top_k=5)
    assert hits[0].document == "rank.txt"
    assert hits[0].score >= hits[-1].score


def test_api_search_returns_own_chunks_and_other_tenants_kb_id_is_404(world, client):
    w = world
    url = f"/v1/knowledge_bases/{w.kb['alpha'].pk}/search"
    resp = client.post(url, data=json.dumps({"query": WORD}), content_type="application/json",
                       **bearer(w.secret["alpha"]))
    assert resp.status_code == 200
    texts = [d["text"] for d in resp.json()["data"]]
    assert texts and all("alphasecret" in t for t in texts)
    foreign = client.post(f"/v1/knowledge_bases/{w.kb['beta'].pk}/search", data=json.dumps({"query": WORD}),
                          content_type="application/json", **bearer(w.secret["alpha"]))
    assert foreign.status_code == 404
    assert "betasecret" not in foreign.content.decode()
    # a KB of the own tenant that is not in the key's scope: 403, not its content
    unscoped = client.post(url, data=json.dumps({"query": WORD}), content_type="application/json",
                           **bearer(w.q_secret))
    assert unscoped.status_code == 404  # not even shared with alpha-q


def test_api_search_needs_the_key_scope(world, client):
    w = world
    key, secret = svc.create_api_key(w.org.people["alpha"]["user"], project=w.org.projects["alpha"], name="noscope",
                                     services=[w.service["alpha"]])
    resp = client.post(f"/v1/knowledge_bases/{w.kb['alpha'].pk}/search", data=json.dumps({"query": WORD}),
                       content_type="application/json", **bearer(secret))
    assert resp.status_code == 403


def test_application_chat_retrieves_only_own_tenants_chunks(world, client):
    w = world
    resp = client.post("/v1/applications/helpdesk/chat", content_type="application/json", **bearer(w.secret["beta"]),
                       data=json.dumps({"messages": [{"role": "user", "content": f"What is the {WORD} procedure?"}]}))
    assert resp.status_code == 200, resp.content
    payload = resp.json()
    assert payload["atrium"]["sources"] and all(s["knowledge_base"] == "handbook" for s in payload["atrium"]["sources"])
    sent = w.up.stats.bodies[-1]
    system = sent["messages"][0]
    assert system["role"] == "system"
    assert "betasecret" in system["content"] and "alphasecret" not in system["content"]
    assert sent["model"] == "beta-llm"
    # metered once, to beta's key and project
    from serving.models import GatewayRequest

    req = GatewayRequest.objects.get()
    assert req.project == w.org.projects["beta"] and req.application == w.app["beta"]
    assert req.input_tokens == w.up.stats.prompt_tokens


def test_application_of_another_project_is_404(world, client):
    w = world
    resp = client.post("/v1/applications/helpdesk/chat", content_type="application/json", **bearer(w.q_secret),
                       data=json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    assert resp.status_code == 404
    assert w.up.stats.requests == 0


def test_kb_page_search_shows_only_own_chunks_and_other_tenants_kb_is_404(world, client):
    w = world
    assert client.login(username="alpha-user", password=PASSWORD)
    page = client.get(f"/serving/kbs/{w.kb['alpha'].pk}/", {"q": WORD})
    assert page.status_code == 200
    html = page.content.decode()
    assert "alphasecret" in html and "betasecret" not in html
    assert client.get(f"/serving/kbs/{w.kb['beta'].pk}/", {"q": WORD}).status_code == 404
    listing = client.get("/serving/kbs/").content.decode()
    assert "alpha handbook" in listing and "beta handbook" not in listing


def test_service_pages_hide_other_tenants_services(world, client):
    w = world
    assert client.login(username="alpha-user", password=PASSWORD)
    assert client.get(f"/serving/services/{w.service['alpha'].pk}/").status_code == 200
    assert client.get(f"/serving/services/{w.service['beta'].pk}/").status_code == 404
    assert client.get(f"/serving/keys/{w.key['beta'].pk}/").status_code == 404
    listing = client.get("/serving/").content.decode()
    assert "alpha chat" in listing and "beta chat" not in listing


def test_kb_cannot_be_shared_with_another_tenants_project(world):
    w = world
    with pytest.raises(ValidationError):
        svc.share_knowledge_base(w.org.people["alpha"]["admin"], w.kb["alpha"], all_projects=False,
                                 projects=[w.org.projects["beta"]])
    with pytest.raises(PermissionDenied):
        svc.share_knowledge_base(w.org.people["beta"]["admin"], w.kb["alpha"], all_projects=True)


def test_application_cannot_use_another_tenants_service_or_kb(world):
    w = world
    user = w.org.people["alpha"]["user"]
    with pytest.raises(ValidationError):
        svc.create_application(user, project=w.org.projects["alpha"], slug="x", name="x", service=w.service["beta"])
    with pytest.raises(ValidationError):
        svc.create_application(user, project=w.org.projects["alpha"], slug="y", name="y", service=w.service["alpha"],
                               knowledge_bases=[w.kb["beta"]])


def test_upload_to_another_tenants_kb_is_refused(world):
    w = world
    with pytest.raises(PermissionDenied):
        svc.upload_document(w.org.people["alpha"]["user"], w.kb["beta"], filename="x.txt", content_type="text/plain",
                            data=b"hello")
