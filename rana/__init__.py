"""rana: RaNA adapters (rank + neuron allocation) for Hugging Face causal LMs.

`import rana` stays light (no torch): the top-level shortcuts below import their module on
first use.

    import rana
    model, tokenizer = rana.load("smol-rana")       # = rana.io.load
"""
__version__ = "0.1.0"

# top-level name -> (module, attribute), resolved lazily by __getattr__
_LAZY = {
    "load": ("rana.io", "load"),
    "save": ("rana.io", "save"),
}


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


__all__ = ["__version__", *_LAZY]
