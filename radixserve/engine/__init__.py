"""The engine layer: the Engine (add, step, abort, stats), its one thread (loop), request
preparation off that thread (inputs) and the output side (stop strings, hold-back, text)."""

__all__ = ["Engine"]


def __getattr__(name: str):
    # Engine pulls in torch; the loop and the inputs import without it.
    if name == "Engine":
        from radixserve.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'radixserve.engine' has no attribute {name!r}")
