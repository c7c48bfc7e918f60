"""`rana compress`: its settings (`config`), the pre-flight that checks them and decides the
resources (`job`, `resources`), the layer-by-layer compression loop (`run`), the calibration
passes (`calibrate`), the global budget allocation (`profile`), and where layers live while they are
compressed (`memory`, `streaming`, `residency`, `placement`, `distributed`)."""
from .calibrate import CalibrationError
from .config import METHODS, CompressConfig
from .job import CompressJob, preflight
from .resources import Resources, setup_distributed
from .run import BudgetError, CompressResult, budget_for, calibration_data, compress, compress_model

__all__ = ["CompressConfig", "METHODS", "CompressJob", "Resources", "preflight", "CompressResult", "BudgetError",
           "CalibrationError", "budget_for", "calibration_data", "compress", "compress_model", "setup_distributed"]
