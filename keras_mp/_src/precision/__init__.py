"""Precision: which layer computes in what, and why.

The levels (`levels`, `amp_settings`, `auto_level`), what a level costs a
step (`speed_trace`, `step_cost`: shared with the speed report), the rules as a table
(`layer_kinds`, `rules`), walks of the layer tree (`layer_tree`), the
layer names in `allow`/`deny` checked against the model (`named_layers`), setting
the policies (`policies`), the casts at layers' boundaries (`boundaries`,
`handoff`, `probabilities`, `probability_ops`),
configs that rebuild in the precision set (`loadable_config`), a layer of
the user's that cannot compute in half (`fallback`), initializers without
half kernels (`half_initializers`).

May import: `keras_internals`, `backends`, `optimizer` (the checks of the
optimizer's arguments that `amp_settings` resolves). Never `model` or
`tools` (`tests/test_style.py` checks it).
"""
