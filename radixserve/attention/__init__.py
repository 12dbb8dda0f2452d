"""Paged attention: the KV pool, per-step metadata, and pluggable backends."""

from radixserve.attention.backend import AttentionBackend, AttentionPlan
from radixserve.attention.kv_pool import KVPool
from radixserve.attention.metadata import AttentionMetadata
from radixserve.attention.registry import get_backend_class, resolve_backend_name

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionPlan", "KVPool", "get_backend_class", "resolve_backend_name"]
