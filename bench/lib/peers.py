"""The systems a bench compares radixserve with: llama.cpp's server, found through the
`--llama-server` option or the LLAMA_SERVER variable (never a path written here), and the
GGUF file of a model both serve. (transformers' static batching, the in-process peer, is in
lib/harness.py.)"""

from __future__ import annotations

import argparse
import os


def add_llama_server(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """`--llama-server PATH`, by default $LLAMA_SERVER; unset: the bench leaves llama.cpp out."""
    parser.add_argument("--llama-server", metavar="PATH", default=os.environ.get("LLAMA_SERVER"),
                        help=help or "llama.cpp's llama-server binary (default: $LLAMA_SERVER): served side by side; "
                                     "left out when neither is given")


def gguf_path(model: str) -> str:
    """The GGUF file of a model name radixserve serves ("default", or a packaged model)."""
    from radixserve.model.default_model import default_gguf_path
    from radixserve.model.packaged_models import packaged_gguf

    return str(default_gguf_path() if model == "default" else packaged_gguf(model))
