"""Tools that read a model and report: `precision_summary` (`summary`), the
precision doctor (`doctor`, `doctor_report`, `half_range`), export and
serving copies (`export`), the speed report (`speed_report`,
`speed_trace`, `speed_model`, `gpu_peaks`), and the one table renderer
(`table`).

May import anything in `_src`; nothing in `_src` imports a tool.
"""
