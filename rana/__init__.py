"""rana: RaNA adapters (rank + neuron allocation) for Hugging Face causal LMs.

`import rana` stays light (no torch): the top-level shortcuts below import their module on
first use.

    import rana
    opened = rana.open("smol-rana")                 # any reference: rana folder, alias, hub id, folder, .gguf
    opened.model, opened.tokenizer, opened.plan, opened.provenance
    model, tokenizer = rana.load("smol-rana")       # the short form for a rana folder (= rana.io.load)
"""
__version__ = "0.1.0"

# top-level name -> (module, attribute), resolved lazily by __getattr__
_LAZY = {
    "open": ("rana.io.models", "open"),
    "load": ("rana.io", "load"),
    "save": ("rana.io", "save"),
}


# quant_method "rana" in transformers' quantizer table, once transformers loads it (rana.hf_hook: no
# torch, no transformers imported here)
from . import hf_hook as _hf_hook  # noqa: E402

_hf_hook.install()


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'rana' has no attribute '{name}'")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))


__all__ = ["__version__", *(n for n in _LAZY if n != "open")]  # a star import must not shadow the builtin open
