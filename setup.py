"""Everything is in pyproject.toml, except one file setuptools cannot place: ``rana-hf-quantizer.pth``.

It goes to the root of site-packages, where Python runs it at start-up: it registers rana's
transformers quantizer (`rana.hf_hook`) in processes that never import rana (``transformers serve``,
``lm_eval --model hf``), since transformers has no plugin entry point for quantizers.

Both install paths write it: a wheel (``pip install .``) carries it beside the package (`BuildWithPth`);
an editable install (``pip install -e .``, PEP 660) builds a wheel of its own that holds only the
editable finder, so `EditableWithPth` adds the file to that wheel too.
"""
import importlib.util
import os

from setuptools import setup
from setuptools.command.build_py import build_py

# the file's name and line come from rana/hf_hook.py itself (stdlib-only, so loadable here without rana)
_spec = importlib.util.spec_from_file_location("_rana_hf_hook", os.path.join(os.path.dirname(__file__), "rana", "hf_hook.py"))
_hook = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_hook)
PTH, PTH_LINE = _hook.PTH, _hook.PTH_LINE


class BuildWithPth(build_py):
    def run(self):
        super().run()
        os.makedirs(self.build_lib, exist_ok=True)
        with open(os.path.join(self.build_lib, PTH), "w") as f:
            f.write(PTH_LINE)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, PTH)]


try:  # setuptools >= 64 (pyproject requires 68): PEP 660 editable installs
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # pragma: no cover - older setuptools installs editables through build_py + develop
    editable_wheel = None


class _StrategyWithPth:
    """Wraps setuptools' editable strategy (a static path entry, a finder or a link tree): whatever it
    writes into the editable wheel, plus the hook's .pth at the wheel's root (= site-packages)."""

    def __init__(self, strategy):
        self._strategy = strategy

    def __enter__(self):
        self._strategy.__enter__()
        return self

    def __exit__(self, *exc):
        return self._strategy.__exit__(*exc)

    def __call__(self, wheel, files, mapping):
        self._strategy(wheel, files, mapping)
        wheel.writestr(PTH, PTH_LINE)


commands = {"build_py": BuildWithPth}
if editable_wheel is not None and hasattr(editable_wheel, "_select_strategy"):
    class EditableWithPth(editable_wheel):
        def _select_strategy(self, *args, **kwargs):
            return _StrategyWithPth(super()._select_strategy(*args, **kwargs))

    commands["editable_wheel"] = EditableWithPth

setup(cmdclass=commands)
