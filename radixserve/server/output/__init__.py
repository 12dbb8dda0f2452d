"""The server's one output pipeline: each engine request's typed events (events.py), built
once from the engine loop's per-step deltas, with its usage and ids computed here; every
API (chat, completions, Responses, Anthropic) is a thin encoder of them."""
