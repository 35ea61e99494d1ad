"""The optimizer: `LossScaleOptimizer` and what it is made of.

The state machine (`loss_scale`), the wrapper (`loss_scale_optimizer`) and
its stateless step (`stateless`), its config (`serialization`), tf.keras
2's names (`tf_keras_names`), the unscaled-loss warnings (`unscaled_loss`),
state loaded before the build (`deferred_loading`), the wrapped optimizer (`inner_optimizer`),
float32 master copies and compensated updates (`master_weights`,
`compensated`), ZeRO-1 layouts (`zero`), and a custom loop's state kept on
a skipped step (`skipped_state`).

May import: `keras_internals`, `backends`, `precision.levels` (the half
dtypes). Never `model` or `tools` (`tests/test_style.py` checks it).
"""
