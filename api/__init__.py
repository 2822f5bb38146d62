"""HTTP layer: the OpenAI-compatible quart-trio app, schemas, routes, SSE and binds."""
