"""The serving floor: HTTP on starlette + hypercorn. ``http`` is the toolkit every endpoint
shares (errors, bodies, responses, state, disconnects, API key); ``state`` the server state
and the admission and auto-truncate rules; ``args`` the flags and the typed ``ServerArgs``;
``native`` SGLang's endpoints; ``embeddings``; ``metrics``; ``app`` the route table;
``launch`` ``core serve``. The OpenAI API is in ``core.server.openai``. The engine never
imports this package."""
