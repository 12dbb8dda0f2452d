"""The second KV tier in one home: the slot index and copies (index, plain Python), the
slot bytes (store, over mapped pages), the prefetch thread, persistence across restarts,
and Tiering, which sets them up from an EngineConfig."""
