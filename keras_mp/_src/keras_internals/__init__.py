"""Every use of Keras's internals, in one place.

keras_mp reaches into Keras where its public API has no door: the trainer
whose `compile` it extends, the functional model class, a tensor's Keras
mask, the autocast scope, a layer's direct children, a variable's dtype. The
next Keras release may move any of these; this module is the surface it can
break. A name that is missing fails `import keras_mp` with an error naming
the Keras version and the name, not an `AttributeError` deep in a step.

Private attributes of optimizers that keras_mp overrides (`update_step`,
`_apply_weight_decay`, an optimizer's own `_variables`) are the subclassing
surface of `keras.optimizers.Optimizer`, and stay with the code that
overrides them (`compensated.py`, `loss_scale_optimizer.py`).

The surface is split by what it reaches into: `required` (the releases
supported, and `_need`), `layers`, `float8_calls`, `graphs`, `variables`, `training` and
`saving`; every name is read from this package (`keras_internals.recast`).
"""

from keras_mp._src.keras_internals.float8_calls import *
from keras_mp._src.keras_internals.graphs import *
from keras_mp._src.keras_internals.layers import *
from keras_mp._src.keras_internals.required import *
from keras_mp._src.keras_internals.required import _need
from keras_mp._src.keras_internals.saving import *
from keras_mp._src.keras_internals.training import *
from keras_mp._src.keras_internals.variables import *
