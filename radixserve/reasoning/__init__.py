"""Reasoning parsers: the model's reasoning block read out of its answer (`<think>...</think>`
for Qwen 3 and DeepSeek R1, harmony's analysis channel for gpt-oss) into the output
stream's ReasoningDelta events, which each API spells its own way (chat's
`reasoning_content`, Responses' reasoning items, Anthropic's thinking blocks).

One module per format (deepseek_r1, qwen3, gpt_oss), registered in registry.py by vLLM's
names; mode.py puts the reasoning block ahead of a constrained answer (and bounds it by a
token budget); tokens.py counts the tokens it took. The server's one `Reasoning`
(--reasoning-parser, or `auto` from the chat template in force) is server/reasoning.py."""
