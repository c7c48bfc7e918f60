"""Architecture registry: one small file per architecture."""
from .base import (
    BLOCKS,
    NORM_TYPES,
    ROLES,
    ArchSpec,
    UnsupportedArchitectureError,
    decoder_layers,
    get_arch,
    register,
    set_submodule,
    stubbed_decoder_layers,
    supported_model_types,
    text_config,
)
from . import (gemma, gemma2, gemma3_text, gpt_neox, granite, llama, mistral, olmo2, phi3, qwen2,  # noqa: F401
               qwen3, smollm3, gemma3, qwen3_moe, mixtral, olmoe)  # (registration side effects)

__all__ = [
    "BLOCKS",
    "NORM_TYPES",
    "ROLES",
    "ArchSpec",
    "UnsupportedArchitectureError",
    "decoder_layers",
    "get_arch",
    "register",
    "set_submodule",
    "stubbed_decoder_layers",
    "supported_model_types",
    "text_config",
]
