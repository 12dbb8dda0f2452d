"""Model loading and radixserve's own Llama-family forward."""

from radixserve.model.loader import LoadedModel, load_model
from radixserve.model.spec import ModelSpec

__all__ = ["LoadedModel", "ModelSpec", "load_model"]
