"""The affinity routers and prefill pickers living in this process, by application name.

Its own module: Ray pickles the router's module by value, and a registry there would be
copied instead of shared.
"""

from __future__ import annotations

import weakref
from typing import Any

_ROUTERS: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
_PICKERS: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
_KV_INDEXES: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


def register(app_name: str, router: Any) -> None:
    _ROUTERS[app_name] = router


def router_for(app_name: str) -> Any:
    """The PrefixAffinityRouter of `app_name` in this process (the ingress's), or None."""
    return _ROUTERS.get(app_name)


def register_picker(app_name: str, picker: Any) -> None:
    _PICKERS[app_name] = picker


def register_kv_index(app_name: str, index: Any) -> None:
    _KV_INDEXES[app_name] = index


def kv_index_for(app_name: str) -> Any:
    """The KVBlockIndex the ingress of `app_name` feeds from the replicas' KV events, or None."""
    return _KV_INDEXES.get(app_name)


def picker_for(app_name: str) -> Any:
    """The ingress's PrefillPicker of `app_name` in this process (disaggregated), or None."""
    return _PICKERS.get(app_name)
