"""SGLang's server endpoints beside /generate, so that SGLang clients (`sgl.RuntimeEndpoint`,
scripts written for an SGLang server) run against radixserve unchanged:

- GET /get_model_info: {"model_path", "tokenizer_path", "is_generation": true, ...}
- GET /get_server_info (and /server_info): the engine options, the KV pool, the version
- POST /abort_request {"rid": str} or {"abort_all": true}: ends the /generate calls
  holding those rids; they answer with finish_reason {"type": "abort"}
- GET or POST /flush_cache, with or without a body: drops every unused prefix-cache entry

With API keys set, rids are per key (another key's rid is unknown to a caller: aborting it
ends nothing, and any key may use any rid), abort_all ends the caller's own calls (every
call with an admin key), and /flush_cache drops the caller's cache namespace only; the
whole cache takes an admin key (`--admin-api-key`), and so does any flush where keys share
one cache namespace.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import radixserve
from radixserve.engine.protocol import EngineProtocol
from radixserve.server.api.serving import server_state
from radixserve.server.errors import APIError, bad_request
from radixserve.server.middleware import may_act_for_all, tenant, tenant_namespace
from radixserve.server.protocol.body import read_body, read_json
from radixserve.server.protocol.common import parse
from radixserve.server.protocol.sglang import AbortRequest, FlushCacheRequest
from radixserve.server.request_group import RequestGroup


def routes() -> list[Route]:
    return [
        Route("/get_model_info", get_model_info, methods=["GET"]),
        Route("/get_server_info", get_server_info, methods=["GET"]),
        Route("/server_info", get_server_info, methods=["GET"]),  # the path RuntimeEndpoint.get_server_info uses
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
    ]


async def get_model_info(request: Request) -> Response:
    engine = _engine(request)
    path = _model_path(engine)
    return JSONResponse({
        "model_path": path,
        "tokenizer_path": path,
        "is_generation": True,
        "served_model_name": server_state(request).served.names[0],
        "max_model_len": engine.max_model_len,
    })


async def get_server_info(request: Request) -> Response:
    engine = _engine(request)
    state = server_state(request)
    return JSONResponse({
        "version": radixserve.__version__,
        "model_path": _model_path(engine),
        "engine": dataclasses.asdict(engine.config),
        "server": state.options.reported(),
        "max_model_len": engine.max_model_len,
        "block_size": engine.config.block_size,
        "num_kv_blocks": engine.pool.num_blocks,
        "max_total_num_tokens": engine.pool.num_blocks * engine.config.block_size,
        "attention_backend": engine.attention_backend,
        "weight_dtype": engine.loaded.weight_dtype,
        "weight_bytes": engine.loaded.weight_bytes,
        "stats": state.engine.latest_stats,
    })


async def abort_request(request: Request) -> Response:
    body = parse(AbortRequest, await read_json(request))
    table = rid_table(request.app)
    owner = tenant(request.scope)
    if body.abort_all:
        return JSONResponse({"aborted": table.abort_all(None if may_act_for_all(request.scope) else (owner,))})
    if body.rid is None:
        raise bad_request("give 'rid' (or 'abort_all': true)", param="rid")
    return JSONResponse({"aborted": int(table.abort(owner, body.rid))})


async def flush_cache(request: Request) -> Response:
    raw = await read_body(request, 1 << 16)
    if raw.strip():
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise bad_request(f"request body is not valid JSON: {exc}") from None
        parse(FlushCacheRequest, body)
    namespace = _flushed_namespace(request)
    freed = await server_state(request).engine.call(lambda engine: engine.flush_cache(namespace))
    return JSONResponse({"freed_blocks": freed, "flushed": "all" if namespace is None else "own"})


def _flushed_namespace(request: Request) -> str | None:
    """The cache namespace a caller's flush drops: everything (no keys, or an admin key),
    else its own key's; refused where every key shares one namespace."""
    if may_act_for_all(request.scope):
        return None
    if server_state(request).options.shared_cache_across_keys:
        raise APIError(403, "the API keys share one prefix cache (--shared-cache-across-keys): flushing it takes "
                       "an admin key (--admin-api-key)", type="permission_error", code="admin_key_required")
    return tenant_namespace(request.scope)


class RidTable:
    """Client request ids (`rid`) of the /generate calls running now, per tenant (the
    owner: an API key's digest, None without keys), and the groups that an abort by rid
    ended. Event loop only."""

    def __init__(self) -> None:
        self._groups: dict[tuple[str | None, str], RequestGroup] = {}
        self._aborted: set[str] = set()

    def check_free(self, owner: str | None, rids: list[str] | None) -> None:
        """400 for a rid a running request of the same owner already holds (checked before submitting)."""
        for rid in rids or []:
            if (owner, rid) in self._groups:
                raise bad_request(f"rid '{rid}' is in use by a running request", param="rid")

    def hold(self, owner: str | None, rids: list[str] | None, group: RequestGroup) -> None:
        """Register the rids of a submitted group; a rid taken meanwhile aborts the group (400)."""
        if not rids:
            return
        if any((owner, rid) in self._groups for rid in rids):
            group.abort()
            self.check_free(owner, rids)
        for rid in rids:
            self._groups[(owner, rid)] = group

    def release(self, owner: str | None, rids: list[str] | None, group: RequestGroup) -> None:
        for rid in rids or []:
            if self._groups.get((owner, rid)) is group:
                del self._groups[(owner, rid)]
        self._aborted.discard(group.group_id)

    def abort(self, owner: str | None, rid: str) -> bool:
        group = self._groups.get((owner, rid))
        if group is None or group.done:
            return False
        self._aborted.add(group.group_id)
        group.abort()
        return True

    def abort_all(self, owners: tuple[str | None, ...] | None = None) -> int:
        """Abort the running calls of `owners` (None: of everyone); returns how many."""
        held = [key for key in self._groups if owners is None or key[0] in owners]
        return sum(self.abort(owner, rid) for owner, rid in held)

    def aborted(self, group: RequestGroup) -> bool:
        """The group was ended by /abort_request (not by a disconnect, timeout or error)."""
        return group.group_id in self._aborted


def rid_table(app: Any) -> RidTable:
    """The app's RidTable (made on first use)."""
    table = getattr(app.state, "sglang_rids", None)
    if table is None:
        table = app.state.sglang_rids = RidTable()
    return table


def _model_path(engine: EngineProtocol) -> str:
    return str(engine.config.model or engine.loaded.path)


def _engine(request: Request) -> EngineProtocol:
    return server_state(request).engine.engine
