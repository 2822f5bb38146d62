"""Route blueprints of the OpenAI-compatible API."""
