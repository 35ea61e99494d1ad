"""Pieces the benchmark scripts share."""


def fastest_decile(samples):
    """Mean of the fastest tenth of the samples (at least one).

    Noise on a shared machine only adds time, so this is the steadier
    estimate of what a step costs; unlike medians of ratios, ratios of these
    compose (a/b times b/c is a/c).
    """
    fast = sorted(samples)[: max(1, len(samples) // 10)]
    return sum(fast) / len(fast)


def without_telemetry(model):
    """Gives a compiled model back Keras's own train step: keras_mp's step
    without `loss_scale` and `skipped_steps` in the logs."""
    model.__dict__.pop("train_step", None)
    model.train_function = None
