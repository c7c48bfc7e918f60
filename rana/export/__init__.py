"""`rana export`: a rana folder → a folder that plain transformers loads (trust_remote_code=True).

    run.py     export(): weights, config.json, copied files, model card
    render.py  the shipped remote code, rendered from rana's sources and checked
    template/  configuration_rana.py and modeling_rana.py, the remote-code entry points
"""
from .render import SHIPPED_MODULES, ExportError, check_sources, module_source, render_sources, rewrite_imports
from .config import ExportConfig
from .run import export, export_folder, export_state_dict, exported_config, write_weights

__all__ = ["ExportConfig", "export_folder", "export", "export_state_dict", "exported_config", "write_weights", "render_sources", "check_sources",
           "module_source", "rewrite_imports", "ExportError", "SHIPPED_MODULES"]
