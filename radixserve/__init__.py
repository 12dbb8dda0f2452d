"""radixserve: a prefix-sharing LLM serving runtime.

    from radixserve import Engine, SamplingParams
    engine = Engine()                       # the default SmolLM2-135M-Instruct
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0.0))
"""

from radixserve.config import EngineConfig
from radixserve.outputs import RequestOutput, TokenLogprob
from radixserve.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams", "TokenLogprob"]


def __getattr__(name: str):
    # Engine pulls in torch and transformers; import it on first use so `radixserve --help` stays fast.
    if name == "Engine":
        from radixserve.engine import Engine

        return Engine
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
