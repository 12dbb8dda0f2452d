"""Real prompts for bench_kv_quant and bench_weights (raw text openings and chat questions, of
varied kinds, tokenized by an engine) and the attention metadata their accuracy runs step with."""

from __future__ import annotations

import torch

from radixserve.attention.metadata import AttentionMetadata

BLOCK = 16

RAW = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
    "The mitochondria is often called the powerhouse of the cell because",
    "import numpy as np\n\ndef normalize(v):\n",
    "In 1969, Neil Armstrong became the first person to",
    "The three primary colors of light are",
    "Dear hiring manager,\n\nI am writing to apply for the position of",
    "SELECT name, COUNT(*) FROM orders",
    "The French Revolution began in 1789 when",
    "Photosynthesis is the process by which plants",
    "class Stack:\n    def __init__(self):\n",
    "The quick brown fox jumps over the lazy dog. This sentence is famous because",
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes",
    "Chapter 1\n\nIt was a cold and rainy night when the detective first heard",
    "The Pythagorean theorem states that",
    "Ingredients: 2 cups flour, 1 cup sugar, 3 eggs.\nInstructions:",
    "A black hole is a region of spacetime where",
    "#!/bin/bash\n# Back up the home directory every night\n",
    "The main differences between TCP and UDP are",
    "Shakespeare wrote many plays, including",
    "The stock market fell sharply on Monday after",
    "To install the package, run the following command:",
    "Machine learning is a field of computer science that",
    "The Great Wall of China was built to",
]

CHAT = [
    "What is 17 * 3?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "Explain why the sky is blue in one paragraph for a ten-year-old.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a short recipe for pancakes.",
    "How do vaccines train the immune system?",
    "Translate 'good morning, how are you?' into French.",
    "Write a limerick about a cat who loves coffee.",
    "What are the planets of the solar system, in order from the sun?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "How can I improve my sleep?",
    "Write a Python function that checks whether a string is a palindrome.",
    "What causes the seasons on Earth?",
    "Give three tips for a job interview.",
    "Explain what an API is to someone who does not program.",
    "What is the boiling point of water in Fahrenheit?",
    "Write a two-line poem about autumn leaves.",
    "Why do we have leap years?",
    "Suggest a name for a friendly robot and explain why.",
    "What is the capital of Japan, and what is it known for?",
    "How does a bicycle stay upright when moving?",
    "Describe the water cycle briefly.",
    "What is a prime number? Give five examples.",
    "Write a short thank-you note to a teacher.",
    "What should I pack for a weekend hiking trip?",
]


def attention_metadata(num_decodes, query_start, seq_lens, tables, slots) -> AttentionMetadata:
    """One attention step's metadata on the CPU: `num_decodes` decode rows first, then prefills."""
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        num_decodes=num_decodes, block_size=BLOCK,
        query_start_loc=torch.tensor(query_start, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_list=list(query_start), seq_lens_list=list(seq_lens),
    )


def tokenized_prompts(engine, count: int) -> list[list[int]]:
    """`count` prompts: half raw openings, half chat questions in the model's template."""
    half = -(-count // 2)
    raw = [engine.tokenizer.encode(p) for p in RAW[:half]]
    chat = [engine.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT[: count - len(raw)]]
    return raw + chat
