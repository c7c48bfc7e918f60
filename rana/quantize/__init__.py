"""int8 weights for rana models and folders (`rana quantize`, `rana compress --weights int8`): see run.py;
the command's settings in config.py."""
from .config import QuantizeConfig
from .run import (DEFAULT_CALIB_TOKENS, QuantizeError, active_fractions, calibration_ids, check_quantizable,
                  check_weights, quantize_folder, quantize_model, quantize_targets)

__all__ = ["DEFAULT_CALIB_TOKENS", "QuantizeConfig", "QuantizeError", "active_fractions", "calibration_ids",
           "check_quantizable", "check_weights", "quantize_folder", "quantize_model", "quantize_targets"]
