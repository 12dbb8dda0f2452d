"""The Dynamo worker: an engine on its own thread (EngineLoop), registered with Dynamo's
runtime as a token-in, token-out model, its KV events relayed to Dynamo's KV router.

    python -m radixserve.dynamo --model smollm2-135m --discovery-backend file
    python -m dynamo.frontend --router-mode kv --discovery-backend file  # + ROUTER_ARGS below

The engine publishes its events on a loopback ZMQ socket in vLLM's current format, blocks
named by their low 64 bits (all Dynamo 1.6 decodes), and Dynamo's KvEventPublisher relays
them onto Dynamo's event plane: the router's view is the engine's cache, medium by medium
("GPU": the pool the model reads; "CPU" / "DISK": the second tier), a tenant's namespace
from its first block's extra_keys. A request Dynamo's frontend sends that the engine
cannot honour ends with an error naming the field (request.py)."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from radixserve.dynamo.request import engine_request
from radixserve.engine.kv_events import wire_name

log = logging.getLogger("radixserve.dynamo")
FINISH = {"stop": "stop", "length": "length", "abort": "cancelled"}
# Dynamo 1.6.1's frontend flags for routing to these workers (docs/cluster.md, "NVIDIA Dynamo"):
# - prefill weighed 8x a resident block: on a CPU worker a decode step costs a token a request,
#   a block of prefill 16 (Dynamo's default, 1, is a GPU's, whose decode reads every block);
# - a prefix routed to a worker counts as held there for 10 s, until its KV events arrive (a
#   prompt's wait and prefill here), so requests that share it and come meanwhile follow it;
# - a held block offsets two blocks of queued prefill: otherwise a worker still computing a
#   prefix (its whole prompt queued) always loses to an idle one, which computes it again.
ROUTER_ARGS = ("--router-prefill-load-scale", "8", "--router-predicted-ttl-secs", "10",
               "--router-kv-overlap-score-credit", "2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m radixserve.dynamo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model name or directory (default: the default model)")
    parser.add_argument("--served-model-name", default=None, help="the name clients ask for (default: the model's)")
    parser.add_argument("--endpoint", default="dyn://radixserve.backend.generate", help="namespace.component.endpoint")
    parser.add_argument("--discovery-backend", default=os.environ.get("DYN_DISCOVERY_BACKEND", "file"),
                        choices=("file", "etcd", "kubernetes", "mem"))
    parser.add_argument("--request-plane", default="tcp", choices=("tcp", "nats"))
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--kv-offload-memory", type=int, default=0, help="bytes of second tier (0: none)")
    parser.add_argument("--kv-events-port", type=int, default=0,
                        help="the loopback port the engine publishes its KV events on, its replay socket on the next "
                             "(0: any; fixed, a restarted worker's stream is found again by other subscribers, "
                             "e.g. Dynamo's standalone indexer)")
    parser.add_argument("--engine-options", default="{}", help="other EngineConfig options as JSON")
    return parser.parse_args(argv)


def card_dir(model_dir: Path) -> Path:
    """A directory Dynamo can load the model's card from: the model's own, or (a conversion
    older than `convert` writing its architectures) a copy of its small files that names them,
    at a path fixed by the model's, so that every worker of the model presents the same card
    (Dynamo's frontend keeps the first card's workers and rejects those whose card differs)."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("architectures"):
        return model_dir
    from radixserve.model.default_model import _architectures

    digest = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:16]
    card = Path(tempfile.gettempdir()) / f"radixserve-dynamo-card-{model_dir.name}-{digest}"
    card.mkdir(exist_ok=True)
    config["architectures"] = _architectures(config.get("model_type", ""))
    files = {p.name: p.read_bytes() for p in model_dir.iterdir() if p.is_file() and p.suffix != ".safetensors"}
    files["config.json"] = json.dumps(config, indent=2).encode()
    for name, data in files.items():  # written whole and renamed: workers starting together see one card
        if not (card / name).exists() or (card / name).read_bytes() != data:
            tmp = card / f".{name}.{os.getpid()}"
            tmp.write_bytes(data)
            os.replace(tmp, card / name)
    return card


class Worker:
    """The handler Dynamo calls for each request: prepare off the engine thread, submit, and
    yield each step's new token ids."""

    def __init__(self, engine, loop, instance_id: int | None = None):
        self.engine, self.engine_loop = engine, loop
        self.instance_id = instance_id  # Dynamo's id of this worker (the router's name for it)

    async def cache_blocks(self, body: dict) -> dict:
        """The engine's cached blocks as its KV events name them (64-bit), by medium; with
        {"flush": true} the cache is flushed first (Dynamo's system server: /engine/cache_blocks),
        with the worker's Dynamo instance id."""
        def read(engine) -> dict:
            if body.get("flush"):
                engine.flush_cache()
            pool, tier = [], []
            for node in engine.cache.nodes():
                names = [wire_name(d, "chained64") for d in node.digests]
                pool += names if node.blocks else []
                tier += names if node.slots else []
            return {"worker_id": self.instance_id, "GPU": sorted(pool), "tier": sorted(tier)}

        return await asyncio.wrap_future(self.engine_loop.call(read))

    async def generate(self, request: dict, context: Any = None) -> AsyncIterator[dict]:
        if os.environ.get("RADIXSERVE_DYNAMO_DEBUG"):
            log.info("request %s", json.dumps(request))
        try:
            wanted = engine_request(request)
            prepared = await asyncio.to_thread(self.engine.prepare, wanted.token_ids, wanted.params,
                                               wanted.cache_salt, wanted.session_id, wanted.hints)
        except ValueError as exc:  # Dynamo's frontend answers a 400 with the message
            from dynamo.llm.exceptions import InvalidArgument

            raise InvalidArgument(str(exc)) from None
        aio = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        request_id = f"dyn-{uuid.uuid4().hex}"
        self.engine_loop.submit([prepared], lambda out: aio.call_soon_threadsafe(outputs.put_nowait, out),
                                [request_id])
        sent = 0
        try:
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    yield {"token_ids": [], "finish_reason": f"error: {out}"}
                    return
                tokens = out.token_ids
                chunk: dict[str, Any] = {"token_ids": list(tokens[sent:])}
                sent = len(tokens)
                if out.finished:
                    chunk["finish_reason"] = FINISH.get(out.finish_reason, out.finish_reason)
                    chunk["completion_usage"] = {"prompt_tokens": len(wanted.token_ids), "completion_tokens": sent,
                                                 "total_tokens": len(wanted.token_ids) + sent,
                                                 "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}
                yield chunk
                if out.finished:
                    return
        finally:
            if sent == 0 or not out.finished:
                self.engine_loop.abort([request_id])


async def serve(args: argparse.Namespace) -> None:
    from dynamo.llm import KvEventPublisher, ModelInput, ModelType, WorkerType, register_model
    from dynamo.runtime import DistributedRuntime

    from radixserve import Engine
    from radixserve.engine.loop import EngineLoop

    options = json.loads(args.engine_options)
    if args.num_kv_blocks:
        options["num_kv_blocks"] = args.num_kv_blocks
    if args.kv_offload_memory:
        options["kv_offload_memory"] = args.kv_offload_memory
    port, replay = (args.kv_events_port, args.kv_events_port + 1) if args.kv_events_port else ("*", "*")
    engine = Engine(args.model, block_size=args.block_size, kv_events_endpoint=f"tcp://127.0.0.1:{port}",
                    kv_events_replay_endpoint=f"tcp://127.0.0.1:{replay}", kv_events_hash="chained64", **options)
    engine_loop = EngineLoop(engine, name="radixserve-dynamo-engine")
    runtime = DistributedRuntime(asyncio.get_running_loop(), args.discovery_backend, args.request_plane)
    endpoint = runtime.endpoint(args.endpoint)
    publisher = KvEventPublisher(endpoint=endpoint, kv_block_size=args.block_size,
                                 zmq_endpoint=engine.kv_events.endpoint, zmq_topic="")
    model_dir = Path(engine.loaded.path)
    name = args.served_model_name or engine.loaded.name
    worker = Worker(engine, engine_loop, endpoint.connection_id())
    runtime.register_engine_route("cache_blocks", worker.cache_blocks)
    try:
        await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, endpoint,
                             str(card_dir(model_dir)), name, kv_cache_block_size=args.block_size,
                             worker_type=WorkerType.Aggregated, needs=[])
        log.info("radixserve worker %s serves %s at %s, KV events at %s; route with python -m dynamo.frontend "
                 "--router-mode kv %s", endpoint.connection_id(), name, args.endpoint, engine.kv_events.endpoint,
                 " ".join(ROUTER_ARGS))
        await endpoint.serve_endpoint(worker.generate)
    finally:
        publisher.shutdown()
        engine_loop.shutdown()
        engine.close()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO)
    args = parse_args(argv)
    import uvloop

    uvloop.run(serve(args))
    return 0
