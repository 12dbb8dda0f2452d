"""The affinity routers and prefill pickers living in this process, by application name.

Its own module: Ray pickles the router's module by value, and a registry there would be
copied instead of shared.
"""

from __future__ import annotations

import weakref
from typing import Any

_ROUTERS: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()
_PICKERS: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


def register(app_name: str, router: Any) -> None:
    _ROUTERS[app_name] = router


def router_for(app_name: str) -> Any:
    """The PrefixAffinityRouter of `app_name` in this process (the ingress's), or None."""
    return _ROUTERS.get(app_name)


def register_picker(app_name: str, picker: Any) -> None:
    _PICKERS[app_name] = picker


def picker_for(app_name: str) -> Any:
    """The ingress's PrefillPicker of `app_name` in this process (disaggregated), or None."""
    return _PICKERS.get(app_name)
