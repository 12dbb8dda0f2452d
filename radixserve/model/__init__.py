"""Model loading and radixserve's own Llama-family forward."""

from radixserve.model.spec import ModelSpec

__all__ = ["LoadedModel", "ModelSpec", "load_model"]


def __getattr__(name: str):
    # The loader pulls in torch; a submodule read without it (builtin_template, for the cluster's
    # ingress) must not import it, so the loader is imported on first use.
    if name in ("LoadedModel", "load_model"):
        from radixserve.model import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'radixserve.model' has no attribute {name!r}")
