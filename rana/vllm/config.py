"""quant_method "rana" for vLLM: the export's ``quantization_config`` read, checked and turned into one linear
method per layer (rana.vllm.methods). Imported only inside vLLM processes (rana.vllm.register)."""
from __future__ import annotations

import re
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from ..kernels.cpu_gemv import A8_BLOCK_UNRECORDED
from .layout import INT8_DENSE, NotServed, adapters_by_path, fused_parts, refusal, weight_renames
from .support import check_vllm

QUANT_METHOD = "rana"


class RanaVllmConfig(QuantizationConfig):
    """What config.json's quantization_config records (rana.quantizer.RanaQuantizationConfig's fields), checked
    by the schema every rana loader runs, then refused in one line if vLLM cannot serve it exactly."""

    def __init__(self, record: dict):
        super().__init__()
        self.record = record
        self.specs = adapters_by_path(record)
        int8 = record.get("int8") or {}
        self.int8_modules = set(int8.get("modules") or []) if record.get("weights") == "int8" else set()
        self.activations = int8.get("activations") or "float"
        self.activation_block = int8.get("activation_block") or A8_BLOCK_UNRECORDED  # int8 activations' block

    # ---- what vLLM asks every quantization config -------------------------------------------------
    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 70  # the Triton kernels (Volta and newer)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "RanaVllmConfig":
        check_vllm()
        from ..io.loadchecks import check_record, record_of

        check_record(record_of(config.get), where="the quantization_config ('rana') in config.json",
                     fix="re-export the model with `rana export`")
        record = {k: config.get(k) for k in ("format_version", "adapters", "weights", "int8", "laurel")}
        why = refusal(record)
        if why:
            raise NotServed(why)
        return cls(record)

    # ---- per layer -----------------------------------------------------------------------------
    def is_int8(self, specs: list[dict], child: str) -> bool:
        """Whether `child` of the projections `specs` holds int8 codes (all or none: else refused)."""
        flags = {(f"{s['path']}.{child}" if child else s["path"]) in self.int8_modules for s in specs}
        if len(flags) > 1:
            raise NotServed(f"rana: {', '.join(s['path'] for s in specs)} mix int8 and float weights in one vLLM layer")
        return flags.pop()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from .methods import RanaHeadMethod, RanaLinearMethod

        if isinstance(layer, ParallelLMHead):
            spec = self.specs.get(prefix)
            if spec is None and prefix in self.int8_modules:  # a dense head `rana quantize` made int8
                spec = {"path": prefix, "type": INT8_DENSE, "out": layer.org_vocab_size}
            return RanaHeadMethod(self, prefix, spec) if spec is not None else None
        if not isinstance(layer, LinearBase):
            return None  # embeddings, attention, experts: vLLM's own methods (their adapters are refused up front)
        paths = fused_parts(prefix, self.packed_modules_mapping)
        specs = [self.specs.get(p) or ({"path": p, "type": INT8_DENSE} if p in self.int8_modules else None)
                 for p in paths]
        if all(s is None for s in specs):
            return UnquantizedLinearMethod()
        if any(s is None for s in specs):
            dense = [p for p, s in zip(paths, specs) if s is None]
            raise NotServed(f"rana: vLLM fuses {', '.join(paths)} into {prefix}, but {', '.join(dense)} "
                            f"{'is' if len(dense) == 1 else 'are'} dense: rana's vLLM plugin cannot serve that mix")
        return RanaLinearMethod(self, prefix, specs)

    def get_checkpoint_weight_mapper(self):
        from vllm.model_executor.models.utils import WeightsMapper

        renames = weight_renames(self.record, self.packed_modules_mapping)
        base = QuantizationConfig.get_checkpoint_weight_mapper()
        return base | WeightsMapper(orig_to_new_regex={re.compile(k): v for k, v in renames.items()})


__all__ = ["RanaVllmConfig", "QUANT_METHOD"]
