"""Method catalogue: one file per family, each ending with its `register(Method(...))` lines
(as `rana/archs/` does for architectures). `names()` lists them, `get_method(name)` returns one."""
from .base import (
    METHODS,
    InputStats,
    LayerContext,
    MemoryNeed,
    Method,
    Step,
    adapter_entry,
    dense_entry,
    get_method,
    install_choice,
    install_rank_qkv,
    install_stacked_qkv,
    names,
    qkv_modules,
    register,
    relative_error,
    sparse_choice,
    summary,
    unregister,
    unsupported_reason,
)
from .rana import Candidates, fused_gate_up_act, rana_method
# registration side effects, in the order `names()` lists the methods (the CLI help shows it)
from . import rana, cats, svd, teal, rsparse, larosa, wina_ortho  # noqa: F401,E402  isort: skip

__all__ = [
    "METHODS",
    "Candidates",
    "InputStats",
    "LayerContext",
    "MemoryNeed",
    "Method",
    "Step",
    "adapter_entry",
    "dense_entry",
    "fused_gate_up_act",
    "get_method",
    "install_choice",
    "install_rank_qkv",
    "install_stacked_qkv",
    "names",
    "qkv_modules",
    "rana_method",
    "register",
    "relative_error",
    "sparse_choice",
    "summary",
    "unregister",
    "unsupported_reason",
]
