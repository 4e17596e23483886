"""Model services, knowledge bases and API keys (built out by the serving issue)."""
