"""The HTTP request bodies as pydantic models (validated, then turned into engine jobs),
their JSON schema for /openapi.json, and the JSON body reader in front of them."""

from radixserve.server.protocol.chat import ChatCompletionRequest
from radixserve.server.protocol.common import ServedModel, parse
from radixserve.server.protocol.completions import CompletionRequest
from radixserve.server.protocol.generate import GenerateRequest, GenerateSamplingParams
from radixserve.server.protocol.jobs import GenerationJob, NativeJob

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "GenerateRequest",
    "GenerateSamplingParams",
    "GenerationJob",
    "NativeJob",
    "ServedModel",
    "parse",
]
