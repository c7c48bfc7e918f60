"""int8 weights for rana models and folders (`rana quantize`, `rana compress --weights int8`): see run.py;
the command's settings, its error and its default calibration size in config.py."""
from .config import DEFAULT_CALIB_TOKENS, QuantizeConfig, QuantizeError
from .run import (active_fractions, calibration_ids, check_quantizable, check_weights, quantize_folder, quantize_model,
                  quantize_targets)

__all__ = ["DEFAULT_CALIB_TOKENS", "QuantizeConfig", "QuantizeError", "active_fractions", "calibration_ids",
           "check_quantizable", "check_weights", "quantize_folder", "quantize_model", "quantize_targets"]
