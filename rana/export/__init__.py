"""`rana export`: a rana folder → a folder that plain transformers loads (trust_remote_code=True).

    run.py     export(): weights, config.json, copied files, model card
    render.py  the shipped remote code, rendered from rana's sources and checked
    template/  configuration_rana.py and modeling_rana.py, the remote-code entry points
"""
from . import render as _render
from .render import ExportError, check_sources, module_source, render_sources, rewrite_imports
from .config import ExportConfig
from .run import export, export_folder, export_state_dict, exported_config, write_weights

__all__ = ["ExportConfig", "export_folder", "export", "export_state_dict", "exported_config", "write_weights", "render_sources", "check_sources",
           "module_source", "rewrite_imports", "ExportError", "SHIPPED_MODULES"]


def __getattr__(name: str):
    if name == "SHIPPED_MODULES":  # derived when asked for (rana.export.render)
        return _render.SHIPPED_MODULES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
