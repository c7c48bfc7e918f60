"""Registers rana's transformers quantizer (`rana.quantizer`) as soon as transformers can take it.

transformers has no plugin entry point for quantizers (5.17 and 5.24 read only their own tables,
`transformers.quantizers.auto`), so a process that never imports rana — ``transformers serve``,
``lm_eval --model hf`` — would not know quant_method "rana". Two doors lead here:

* ``import rana`` calls `install()`;
* the ``rana-hf-quantizer.pth`` file an install of rana puts in site-packages (what ``.pth`` files are
  for) adds, at interpreter start-up, a tiny finder that imports nothing until transformers' quantizer
  table is imported, and only then imports this module (`wrapped_spec`): being installed is enough,
  and a process that never loads a transformers model never imports rana.

`install()` costs one `sys.meta_path` entry and imports nothing heavy: when transformers' quantizer
table is already imported it registers at once, else it waits for that module to be executed and
registers right after. Set ``RANA_NO_HF_HOOK=1`` to switch it off.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys

TARGET = "transformers.quantizers.auto"


def _register() -> None:
    # by name, at call time: rana.quantizer (torch, rana.io) sits far above this start-up module, which
    # `import rana` runs; a static import would put the whole package in rana's import graph
    module = sys.modules.get("rana.quantizer")
    if module is not None and not hasattr(module, "register"):
        return  # rana.quantizer is being imported (it imports transformers' quantizers): it registers itself
    importlib.import_module("rana.quantizer").register()


class _RegisterAfterExec(importlib.abc.Loader):
    """Wraps the real loader of `TARGET`: execute it, then register rana's quantizer."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            _register()
        except ImportError:  # a transformers without the register_* API: rana loads its folders itself
            pass


class _Finder(importlib.abc.MetaPathFinder):
    """Finds `TARGET` with the other finders and hands back its spec with the wrapped loader."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from finding itself
        return wrapped_spec(name)


def wrapped_spec(name: str):
    """`name`'s spec as the other finders give it, its loader wrapped to register rana's quantizer after
    the module runs (the start-up finder of the .pth file calls this too)."""
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.loader is not None:
        spec.loader = _RegisterAfterExec(spec.loader)
    return spec


def install() -> None:
    """Register now when transformers' quantizer table is loaded, else right after it is."""
    if os.environ.get("RANA_NO_HF_HOOK"):  # (the .pth checks it before importing rana)
        return
    if TARGET in sys.modules:
        _register()
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


PTH = "rana-hf-quantizer.pth"
# What the .pth file runs at start-up, kept tiny and free of imports: a finder that does nothing until
# transformers' quantizer table is imported, and only then imports rana (so a Python process that never
# loads a transformers model never imports rana). A failure must never break start-up.
#
# rana is imported from its install, never from a folder that happens to be named `rana` in the working
# directory (an output folder `--out rana`, say): the path finder would take that folder as a namespace
# package ahead of an editable install's finder, and rana would half-import. So the first finder whose
# `rana` is a regular package holding hf_hook.py wins. (exec'd inside site.addpackage: names bound here
# are that function's locals, so the helper is a method and imports are local.)
_STARTUP = """
import os, sys
class RanaHfQuantizerHook:
    def find_spec(self, name, path=None, target=None):
        if name != "transformers.quantizers.auto":
            return None
        sys.meta_path.remove(self)
        try:
            if "rana" not in sys.modules and not self.import_installed_rana():
                return None
            import rana.hf_hook
            return rana.hf_hook.wrapped_spec(name)
        except Exception:
            return None
    def import_installed_rana(self):
        import importlib.util
        for finder in list(sys.meta_path):
            try:
                spec = finder.find_spec("rana", None)
            except Exception:
                continue
            origin = getattr(spec, "origin", None) or ""
            if os.path.basename(origin) != "__init__.py" or \\
                    not os.path.isfile(os.path.join(os.path.dirname(origin), "hf_hook.py")):
                continue
            module = importlib.util.module_from_spec(spec)
            sys.modules["rana"] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop("rana", None)
                raise
            return True
        return False
if not os.environ.get("RANA_NO_HF_HOOK"):
    sys.meta_path.insert(0, RanaHfQuantizerHook())
"""
# .pth lines starting with "import" are executed, one line each
PTH_LINE = f"import sys; exec({_STARTUP!r})\n"


def write_pth() -> str:
    """Put `PTH` in this interpreter's site-packages again (both install paths write it, setup.py; this
    repairs an environment some tool stripped of it). Returns its path."""
    import sysconfig
    from pathlib import Path

    path = Path(sysconfig.get_paths()["purelib"]) / PTH
    path.write_text(PTH_LINE)
    return str(path)


if __name__ == "__main__":  # python -m rana.hf_hook
    print(write_pth())
