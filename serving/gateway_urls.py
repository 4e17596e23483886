"""URLs of the OpenAI-compatible gateway, mounted at /v1/ (API clients only, no sessions)."""

from django.urls import path

from serving import gateway

urlpatterns = [
    path("models", gateway.models, name="gateway_models"),
    path("chat/completions", gateway.chat_completions, name="gateway_chat"),
    path("completions", gateway.completions, name="gateway_completions"),
    path("embeddings", gateway.embeddings, name="gateway_embeddings"),
    path("applications/<slug:slug>/chat", gateway.application_chat, name="gateway_application_chat"),
    path("knowledge_bases/<int:kb_id>/search", gateway.kb_search, name="gateway_kb_search"),
]
