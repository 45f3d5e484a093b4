"""`mstrace serve`: the engine behind an OpenAI-compatible HTTP API (docs/serve.md)."""
