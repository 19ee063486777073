"""OpenAI-compatible endpoints: ``protocol`` (wire structs), ``job`` (what chat and completions
share), ``chat``, ``completions``, ``logprobs``, ``tools`` (tool plan and calls), ``files``,
``batches`` and ``routes`` (the HTTP handlers)."""
