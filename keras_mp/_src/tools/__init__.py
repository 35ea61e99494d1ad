"""Tools that read a model and report: `precision_summary` (`summary`), the
precision doctor (`doctor`, `doctor_report`, `half_range`), export and
serving copies (`export`), the speed report (`speed_report`,
`speed_model`; its accounts are `precision.step_cost`'s, its devices
`backends.gpu_peaks`), the compiled program's census
(`compiled_census`), and the one table renderer
(`table`).

May import anything in `_src`; nothing in `_src` imports a tool.
"""
