"""The serving floor: HTTP (starlette on hypercorn), SGLang's native API, metrics and
embeddings; the OpenAI API in ``core.server.openai``. The engine never imports it."""
