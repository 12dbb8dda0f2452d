"""The server's APIs, one module each: its routes, how a request becomes an engine job, and the
encoder of its answers (whole or streamed) from the output events (server/output/):
completions, chat (OpenAI's chat completions), responses (OpenAI's Responses API), anthropic
(Anthropic's Messages API), native (/generate, in SGLang's spelling), sglang (SGLang's other
endpoints: model and server info, abort by rid, flush the cache), sessions (agent sessions and
pinned prefixes). serving.py holds what their routes share."""
