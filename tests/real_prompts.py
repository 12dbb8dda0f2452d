"""Prompts for the real-model tests: raw text and chat-templated, of very different lengths."""

RAW = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who repaired every clock in the valley. One winter morning, a stranger arrived "
    "carrying a clock that had no hands at all. The clockmaker looked at it for a long time and said",
]
CHAT = [
    "What is 17 * 3?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "Explain, in one paragraph suitable for a ten-year-old, why the sky is blue during the day "
    "and red or orange at sunset. Mention how sunlight is made of many colours, what happens when "
    "light hits the tiny molecules of air, why blue light is scattered more than red light, and "
    "why the path of the light through the atmosphere is longer at sunset. Keep it friendly.",
]


def encode_all(engine):
    """Token ids of every prompt: raw ones through the tokenizer, chat ones through the template."""
    raw = [engine.tokenizer.encode(p) for p in RAW]
    chat = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT]
    return raw + chat
