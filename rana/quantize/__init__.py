"""int8 weights for rana models and folders (`rana quantize`, `rana compress --weights int8`): see run.py."""
from .run import (DEFAULT_CALIB_TOKENS, QuantizeError, active_fractions, calibration_ids, check_quantizable,
                  check_weights, quantize_folder, quantize_model, quantize_targets)

__all__ = ["DEFAULT_CALIB_TOKENS", "QuantizeError", "active_fractions", "calibration_ids", "check_quantizable",
           "check_weights", "quantize_folder", "quantize_model", "quantize_targets"]
