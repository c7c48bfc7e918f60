"""`rana compress`: the layer-by-layer compression loop (`run`), its settings (`config`), the
calibration passes (`calibrate`), the global budget allocation (`profile`), and where layers live
while they are compressed (`memory`, `streaming`, `residency`, `placement`, `distributed`)."""
from .calibrate import CalibrationError
from .config import METHODS, CompressConfig
from .run import BudgetError, CompressResult, budget_for, calibration_data, compress, compress_model, setup_distributed

__all__ = ["CompressConfig", "METHODS", "CompressResult", "BudgetError", "CalibrationError", "budget_for",
           "calibration_data", "compress", "compress_model", "setup_distributed"]
