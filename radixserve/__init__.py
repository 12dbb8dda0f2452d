"""radixserve: a prefix-sharing LLM serving runtime.

    from radixserve import Engine, SamplingParams
    engine = Engine()                       # the default SmolLM2-135M-Instruct
    outs = engine.generate(["Hello"], SamplingParams(max_tokens=16, temperature=0.0))
"""

import os as _os
import sys as _sys

if "torch" not in _sys.modules:
    # torch's OpenMP workers spin for a long while after each op by default; on a small CPU
    # that spinning steals the cores from the C decode-attention threads that run between
    # two torch ops (measured: decode steps 15% faster at a short spin). Set before torch
    # loads libgomp; an explicit setting in the environment wins.
    _os.environ.setdefault("GOMP_SPINCOUNT", "10000")

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
