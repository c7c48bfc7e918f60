"""Decode-time kernels. Import from the submodule: ``from rana.kernels.masked_gemv import masked_gemv``.

(No re-exports here on purpose: a package attribute named ``masked_gemv`` would shadow the
submodule of the same name.)
"""
