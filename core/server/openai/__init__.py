"""OpenAI-compatible endpoints: wire structs, chat, completions, logprobs, tool calls,
files and batches."""
