"""How models enter and leave rana: the folder format (`format`), writing and reading rana
folders (`folder`), and opening any model reference (`models`: `rana.open`)."""
from .folder import (OffloadedLayers, OutputExistsError, atomic_dir, check_folder, check_thresholds, is_rana_dir, load,
                     read_meta, read_plan, save)
from .format import (FORMAT_VERSION, PLAN, RANA_CONFIG, WEIGHTS, WEIGHTS_INDEX, ModelLoadError, adapter_specs,
                     install_empty_adapters, tied_keys, write_json)
from .models import ALIASES, LoadedModel, Provenance, dense_reference, load_model, open_model, resolve

__all__ = ["save", "load", "check_folder", "check_thresholds", "read_meta", "read_plan", "atomic_dir", "is_rana_dir",
           "OutputExistsError", "OffloadedLayers", "FORMAT_VERSION", "WEIGHTS", "WEIGHTS_INDEX", "RANA_CONFIG", "PLAN",
           "ModelLoadError", "adapter_specs", "install_empty_adapters", "tied_keys", "write_json", "ALIASES",
           "LoadedModel", "Provenance", "dense_reference", "load_model", "open_model", "resolve"]
