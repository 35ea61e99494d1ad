"""Compensated (Kahan) updates of bfloat16 variables: no float32 copy.

Master weights cost 4 bytes a weight for the float32 copy, and make the inner
optimizer's slots float32 as well. Where that does not fit, compensated
updates keep the model's bfloat16 variables and a bfloat16 *compensation
buffer* per variable (2 bytes a weight): the part of each update that the
variable could not hold. With Adam that is 8 bytes a weight (variable, buffer
and two bfloat16 slots) against 14 with master weights, as the bfloat16
optimizers of `optimi` and torchao do.

Each step of a bfloat16 variable is computed in float32 from the pair, with
the inner optimizer's settings:

    exact = variable + buffer - decay + update
    variable = bfloat16(exact)
    buffer = bfloat16(exact - variable)

so the pair holds the weight to about 16 significant bits instead of 8, and
small updates accumulate instead of vanishing. The trade-off against master
weights: the weight is known to 16 bits, not 24, and the slots are stored in
bfloat16 (Adam's moments keep their range, not their precision); on PyTorch
the step goes one variable at a time (Keras's fused `torch._foreach` step
does not apply).

Why not on top of any Keras optimizer: Keras's update rules cast their
hyperparameters to the variable's dtype, and in bfloat16 Adam's `beta_2` of
0.999 is 1.0, so its step size `sqrt(1 - beta_2**t)` is 0 and a bfloat16
variable never moves; SGD's momentum of 0.9 becomes 0.898. The float32 rules
here read the optimizer's settings and slots, for `Adam` (and `AdamW`,
`amsgrad` too) and `SGD` (momentum, Nesterov); other optimizers are refused
with the alternative named. Decoupled weight decay (`weight_decay`, with its
exclusions) is folded into the same write. The buffers are variables of the
inner optimizer: saved and restored with it, untouched by a skipped step.
"""

import keras
from keras import ops

from keras_mp._src import backends
from keras_mp._src import keras_internals
from keras_mp._src.optimizer.master_weights import COMPENSATED
from keras_mp._src.optimizer.master_weights import is_half
from keras_mp._src.optimizer.master_weights import state_name


class CompensatedUpdates:
    """Installs compensated writes on `inner_optimizer` for its bfloat16 variables.

    Args:
        inner_optimizer: the built optimizer whose writes are compensated.
        var_list: the variables it was built with.
        skip: indices into `var_list` of variables written as they are
            (`overwrite_with_gradient`).

    Raises:
        ValueError: if a trainable variable is float16 (whose range is too
            narrow for the optimizer's slots: use master weights).
    """

    def __init__(self, inner_optimizer, var_list, skip=frozenset(), layout_of=None):
        layout_of = layout_of or keras_internals.variable_layout
        float16 = [
            v.path for v in var_list if keras.backend.standardize_dtype(v.dtype) == "float16"
        ]
        if float16:
            raise ValueError(
                f"`master_weights={COMPENSATED!r}` compensates bfloat16 variables; "
                f"these are float16: {float16[:3]}{' ...' if len(float16) > 3 else ''}. "
                "Float16 optimizer slots underflow (Adam's second moment of a "
                "1e-4 gradient is below float16's range): use "
                "`master_weights=True` for float16 variables."
            )
        self.optimizer = inner_optimizer
        self.buffers = {}  # position in var_list -> the compensation buffer
        for i, variable in enumerate(var_list):
            if is_half(variable) and i not in skip:
                self.buffers[i] = inner_optimizer.add_variable(
                    shape=variable.shape,
                    initializer="zeros",
                    dtype=variable.dtype,
                    name=state_name(variable, "compensation"),
                    layout=layout_of(variable),
                )
        if self.buffers:
            self._install()

    def _buffer(self, variable):
        index = self.optimizer._trainable_variables_indices.get(self.optimizer._var_key(variable))
        return self.buffers.get(index)

    def _install(self):
        optimizer = self.optimizer
        rule = _RULES.get(getattr(type(optimizer), "update_step", None))
        if rule is None:
            raise ValueError(
                f"`master_weights={COMPENSATED!r}` computes the steps of "
                "`keras.optimizers.Adam`, `AdamW` and `SGD` in float32; the "
                f"inner optimizer is {type(optimizer).__name__}. Use "
                "`master_weights=True` with it."
            )
        update_step, apply_weight_decay = optimizer.update_step, optimizer._apply_weight_decay
        decayed = set()  # keys of the variables whose decay is due this step

        def compensated_update_step(gradient, variable, learning_rate):
            buffer = self._buffer(variable)
            if buffer is None:
                return update_step(gradient, variable, learning_rate)
            learning_rate = _f32(learning_rate)
            exact = ops.add(_f32(variable), _f32(buffer))
            key = optimizer._var_key(variable)
            if key in decayed:
                decayed.discard(key)
                decay = ops.multiply(learning_rate, _f32(optimizer.weight_decay))
                exact = ops.subtract(exact, ops.multiply(exact, decay))
            exact = ops.add(exact, rule(optimizer, _f32(gradient), variable, learning_rate))
            rounded = backends.current.rounded(exact, variable.dtype)
            optimizer.assign(buffer, ops.cast(ops.subtract(exact, rounded), buffer.dtype))
            optimizer.assign(variable, ops.cast(rounded, variable.dtype))

        def compensated_weight_decay(variables):
            if optimizer.weight_decay is None:
                return
            plain = []
            for variable in variables:
                if self._buffer(variable) is None:
                    plain.append(variable)
                elif optimizer._use_weight_decay(backends.current.as_the_optimizer_sees(variable)):
                    decayed.add(optimizer._var_key(variable))
            if plain:  # PyTorch's fused decay refuses an empty list
                apply_weight_decay(plain)

        optimizer.update_step = compensated_update_step
        optimizer._apply_weight_decay = compensated_weight_decay
        backends.current.step_each_variable(optimizer)


# -- the update rules, in float32: (optimizer, gradient, variable, lr) -> update


def _adam(optimizer, gradient, variable, learning_rate):
    index = optimizer._get_variable_index(variable)
    m, v = optimizer._momentums[index], optimizer._velocities[index]
    beta_1, beta_2 = _f32(optimizer.beta_1), _f32(optimizer.beta_2)
    step = _f32(optimizer.iterations + 1)
    m_new = ops.add(_f32(m), ops.multiply(ops.subtract(gradient, _f32(m)), 1.0 - beta_1))
    v_new = ops.add(
        _f32(v), ops.multiply(ops.subtract(ops.square(gradient), _f32(v)), 1.0 - beta_2)
    )
    optimizer.assign(m, ops.cast(m_new, m.dtype))
    optimizer.assign(v, ops.cast(v_new, v.dtype))
    if optimizer.amsgrad:
        v_hat = optimizer._velocity_hats[index]
        v_new = ops.maximum(_f32(v_hat), v_new)
        optimizer.assign(v_hat, ops.cast(v_new, v_hat.dtype))
    alpha = ops.divide(
        ops.multiply(learning_rate, ops.sqrt(1.0 - ops.power(beta_2, step))),
        1.0 - ops.power(beta_1, step),
    )
    return ops.negative(
        ops.divide(ops.multiply(m_new, alpha), ops.add(ops.sqrt(v_new), optimizer.epsilon))
    )


def _sgd(optimizer, gradient, variable, learning_rate):
    step = ops.multiply(gradient, learning_rate)
    if optimizer.momentum == 0:
        return ops.negative(step)
    m = optimizer.momentums[optimizer._get_variable_index(variable)]
    momentum = _f32(optimizer.momentum)
    m_new = ops.subtract(ops.multiply(_f32(m), momentum), step)
    optimizer.assign(m, ops.cast(m_new, m.dtype))
    if optimizer.nesterov:
        return ops.subtract(ops.multiply(m_new, momentum), step)
    return m_new


_RULES = {
    keras.optimizers.Adam.update_step: _adam,
    keras.optimizers.SGD.update_step: _sgd,
}


def _f32(x):
    return ops.cast(x, "float32")
