"""Decode-time kernels: one token through a masked projection.

    modes.py        the mask modes' one table (ids shared by the C and Triton kernels)
    weights.py      the weight operands (FloatWeight, Int8Weight): one type per format, its backend chosen once
    route.py        the entry points (decode_masked, decode_masked_grouped, decode_expert_masked,
                    decode_dense_grouped) and the (entry point, backend) table
    ops.py          the registered torch.library ops a traced decode step calls
    cpu_gemv.py     the native CPU kernel (cpu_gemv.c): build, cache, the bound call
    triton_gemv.py  the Triton kernels, their configs and launches
    torch_gemv.py   the torch paths: reference, dense, gather
    gemv_tune.py    the Triton config tuner (python -m rana.kernels.gemv_tune)

Import from the submodules (``from rana.kernels.route import decode_masked``): nothing is re-exported here.
"""
