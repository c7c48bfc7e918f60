"""Everything is in pyproject.toml, except one file setuptools cannot place: ``rana-hf-quantizer.pth``.

It goes to the root of site-packages, where Python runs it at start-up: it registers rana's
transformers quantizer (`rana.hf_hook`) in processes that never import rana (``transformers serve``,
``lm_eval --model hf``), since transformers has no plugin entry point for quantizers.
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


setup(cmdclass={"build_py": BuildWithPth})
