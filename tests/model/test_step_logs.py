"""When a train step returns the loss-scale telemetry (`step_logs.py`):
each epoch's logs always carry it, each batch's only where something reads
them, at no host read per step otherwise."""

import keras
import numpy as np
import pytest

from tests.model.logged_runs import BATCH
from tests.model.logged_runs import STEPS
from tests.model.logged_runs import BatchLogs
from tests.model.logged_runs import data
from tests.model.logged_runs import model_at
from tests.model.logged_runs import read_value
from tests.model.logged_runs import reference_trace

BACKEND = keras.backend.backend()


@pytest.mark.parametrize("amp_level", ["O2", pytest.param(None, marks=pytest.mark.one_backend)])
def test_epoch_logs_without_batch_callbacks_hold_the_optimizer_state(amp_level):
    """`verbose=0` and no batch hooks: the step does not return the values;
    each epoch's logs still carry them, read from the optimizer."""
    model = model_at(amp_level=amp_level)
    x, y = data()
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    expected = reference_trace(epochs=2)
    assert history.history["loss_scale"] == [expected[STEPS - 1][0], expected[-1][0]]
    assert history.history["skipped_steps"] == [expected[STEPS - 1][1], expected[-1][1]]
    assert np.all(np.isfinite(history.history["loss"])) == (amp_level is not None)
    # Then a batch callback: the values are in each step's logs again.
    recorder = BatchLogs()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[recorder])
    assert len(recorder.batches) == STEPS
    assert recorder.batches[-1] == (read_value(model.optimizer.loss_scale), 6)
    # `train_on_batch` after a `fit(verbose=0)`: its logs carry them too.
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    logs = model.train_on_batch(x[:BATCH], y[:BATCH], return_dict=True)
    assert logs["skipped_steps"] == 8 and logs["loss_scale"] == read_value(
        model.optimizer.loss_scale
    )


@pytest.mark.perf
@pytest.mark.skipif(BACKEND != "torch", reason="counts PyTorch host reads")
def test_fit_reads_no_telemetry_per_step_unless_asked(monkeypatch):
    """The telemetry costs a step nothing: `fit(verbose=0)` brings as many
    values to the host as Keras's own mixed policy with its built-in
    LossScaleOptimizer; with a batch hook, two more per step."""
    import torch

    x, y = data(nan_steps=())
    reads = []
    for name in ("__array__", "numpy", "item", "__bool__", "__float__", "__int__", "tolist"):
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)

    def reads_of_one_epoch(model, callbacks=()):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=list(callbacks))
        reads.clear()
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=list(callbacks))
        return len(reads)

    keras_mp_model = model_at()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        keras_model = model_at(
            optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-2)),
            amp_level=None,
        )
    finally:
        keras.config.set_dtype_policy("float32")
    baseline = reads_of_one_epoch(keras_model)
    assert reads_of_one_epoch(keras_mp_model) <= baseline

    def hook():
        return keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: None)

    asked = reads_of_one_epoch(keras_mp_model, [hook()])
    assert asked >= reads_of_one_epoch(keras_model, [hook()]) + 2 * STEPS
