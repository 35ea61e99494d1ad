"""keras_mp: mixed-precision training for Keras 3.

The public API, in full (implementation lives in `keras_mp._src`):

- `LossScaleOptimizer`: fixed and dynamic loss scaling, skip on overflow.
- `apply_amp(model, level, dtype, ...)`: per-layer dtype policies for the
  precision levels O0-O3 (`LEVELS`), from `ALLOW_LIST` / `DENY_LIST`.
- `Float8Recipe`: how `amp_dtype="float8"` scales its FP8 matmuls.
- `to_float(layer, dtype)`: manual mixed precision for a layer and its
  sublayers.
- `precision_summary(model)`: who computes in what, and why.
- `compile(model, ..., amp_level=...)`; `import keras_mp` also adds the amp
  keywords to `keras.Model.compile` (and changes nothing else for models
  keras_mp did not set the precision of).
- `callbacks.OverflowGuard(patience=...)`: stops a run whose steps keep
  overflowing, with a message that says what to try.
- `analyze(model, x, y)`: the precision doctor: activations against the half
  range, gradient underflow/overflow at the current and the recommended loss
  scale, layers to keep in float32.
- `speed_report(model, x, level=..., dtype=..., device=...)`: why the level
  makes a step faster or not, and by how much at most, computed on any
  machine (FLOPs in half, tensor-core shapes, casts, bytes, launches).
- `export(model, path, dtype="float32", format=...)`: a copy computing in
  the precision it is served in, in any format `keras.Model.export` writes;
  `serving_copy(model, dtype)` is that copy. `import keras_mp` also makes
  `model.export` of a keras_mp model serve what each format's runtime runs.
"""

from keras_mp import callbacks
from keras_mp._src.model.compile import compile
from keras_mp._src.model.compile import install as _install_compile_keywords
from keras_mp._src.optimizer.loss_scale_optimizer import LossScaleOptimizer
from keras_mp._src.precision.float8 import Float8Recipe
from keras_mp._src.precision.layer_kinds import ALLOW_LIST
from keras_mp._src.precision.layer_kinds import DENY_LIST
from keras_mp._src.precision.levels import HALF_DTYPES
from keras_mp._src.precision.levels import LEVELS
from keras_mp._src.precision.policies import apply_amp
from keras_mp._src.precision.policies import to_float
from keras_mp._src.tools.doctor import analyze
from keras_mp._src.tools.export import export
from keras_mp._src.tools.export import install as _install_export
from keras_mp._src.tools.export import serving_copy
from keras_mp._src.tools.speed_report import speed_report
from keras_mp._src.tools.summary import precision_summary

__version__ = "0.1.0"

_install_compile_keywords()
_install_export()

__all__ = [
    "ALLOW_LIST",
    "DENY_LIST",
    "Float8Recipe",
    "HALF_DTYPES",
    "LEVELS",
    "LossScaleOptimizer",
    "analyze",
    "apply_amp",
    "callbacks",
    "compile",
    "export",
    "precision_summary",
    "serving_copy",
    "speed_report",
    "to_float",
]
