"""A seeded Poisson stream never redraws the batches of steps it has drawn (docs/algorithms.md B.3).

Batch t of ``fit(..., sampling_seed=K)`` is a function of (K, t), t the ledger's step count.
After a rollback (load_weights of an earlier file) a second run from step s with K would
train on exactly the batches the first run drew from step s on: two released runs sharing
their batch membership, composed as independent samplings (an understated ε). Each test
records the rows each trained step actually saw (the model's x is the row id) and compares
them with an independent computation: the sampler called directly with (K, t), or a repeat
of the whole run. The rollback tests failed on the code before the guard.
"""

import json
from pathlib import Path
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.sampling import PoissonSampler

N, L, P, K = 64, 8, 16, 2**40 + 5
X = np.arange(N, dtype="float32")[:, None]  # x of row i is i: a trained batch names its rows
Y = np.zeros((N, 1), "float32")
REPO = Path(__file__).parents[2]


class RecordingModel(tf_dp.DPModel):
    """A DPModel that notes the row ids of every step it trains on (mask 1 rows only)."""

    def train_step(self, data):
        tf.py_function(self._note, [data["x"], data["mask"]], [])
        return super().train_step(data)

    def _note(self, x, mask):
        self.batches.append(sorted(int(row) for row in np.asarray(x)[..., 0][np.asarray(mask) > 0]))


def recording_model():
    inputs = keras.Input((1,))
    model = RecordingModel(inputs, keras.layers.Dense(1)(inputs))
    model.batches = []
    model.compile(optimizer=tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss="mse",
                  jit_compile=False)
    return model


def fit_steps(model, steps, seed=K, callbacks=None):
    """``steps`` DP steps of fit; returns the batches they trained on."""
    before = len(model.batches)
    model.fit(X, Y, batch_size=L, physical_batch_size=P, steps_per_epoch=steps, sampling_seed=seed, verbose=0,
              callbacks=callbacks)
    return model.batches[before:]


def sampler_batches(seed, steps):
    """The batches of steps ``steps`` drawn by the sampler itself from (seed, t)."""
    sampler = PoissonSampler(N, L, P, seed)
    return [sorted(sampler.batch(t)[0][sampler.batch(t)[1] > 0].tolist()) for t in steps]


def seed_warnings(caught):
    return [str(w.message) for w in caught if "sampling_seed" in str(w.message)]


def rolled_back_run(path, reload=None):
    """fit 2 steps with K, save, fit 2 more, roll back to the step-2 file, fit 2 steps with K;
    returns (first run's 4 batches, second run's 2 batches, warnings naming sampling_seed).
    ``reload``: a callback class loading the file in on_train_begin (as BackupAndRestore
    restores), instead of load_weights between the fits."""
    model = recording_model()
    first = fit_steps(model, 2)
    model.save_weights(path)
    first += fit_steps(model, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if reload is None:
            model.load_weights(path)
            second = fit_steps(model, 2)
        else:
            second = fit_steps(model, 2, callbacks=[reload(path)])
    assert int(model.privacy_ledger.steps.numpy()) == 4
    return first, second, seed_warnings(caught)


class LoadAtTrainBegin(keras.callbacks.Callback):
    """Rolls the model back to a weights file when training begins, as BackupAndRestore does."""

    def __init__(self, path):
        super().__init__()
        self.path = path

    def on_train_begin(self, logs=None):
        self.model.load_weights(self.path)


@pytest.mark.parametrize("reload", [None, LoadAtTrainBegin], ids=["load_weights", "restored_in_on_train_begin"])
def test_a_rollback_draws_new_batches_reproducibly_and_warns(tmp_path, reload):
    first, second, warned = rolled_back_run(tmp_path / "step2.weights.h5", reload)
    assert first == sampler_batches(K, range(4))  # the first run: today's (K, t) batches
    for redrawn, drawn in zip(second, first[2:]):
        assert redrawn != drawn  # equal with probability 0.78^64 ≈ 1e-7 each, were always equal before the guard
    assert len(warned) == 1 and "step 2" in warned[0] and "generation 1" in warned[0]
    keras.utils.set_random_seed(1234)
    again_first, again_second, _ = rolled_back_run(tmp_path / "again.weights.h5", reload)
    assert (again_first, again_second) == (first, second)  # the whole run repeats bit for bit


def test_a_second_rollback_draws_batches_neither_earlier_run_drew(tmp_path):
    model = recording_model()
    fit_steps(model, 2)
    model.save_weights(tmp_path / "step2.weights.h5")
    runs = [fit_steps(model, 2)]
    for _ in range(2):
        model.load_weights(tmp_path / "step2.weights.h5")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs.append(fit_steps(model, 2))
    for step in range(2):
        assert len({tuple(run[step]) for run in runs}) == 3


def test_continuing_fits_keep_todays_batches_and_stay_silent():
    model = recording_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batches = fit_steps(model, 2) + fit_steps(model, 3)
    assert batches == sampler_batches(K, range(5))
    assert seed_warnings(caught) == []


def test_a_seed_on_a_loaded_trained_model_warns_then_continues_silently(tmp_path):
    trained = recording_model()
    fit_steps(trained, 3)
    trained.save_weights(tmp_path / "trained.weights.h5")
    fresh = recording_model()
    fresh.load_weights(tmp_path / "trained.weights.h5")
    with pytest.warns(UserWarning, match=r"`sampling_seed` is set.*3 DP steps.*sampling_seed=None"):
        fit_steps(fresh, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_steps(fresh, 1)  # continues the steps this seed drew in this process
    assert seed_warnings(caught) == []


def test_a_new_seed_on_a_trained_model_warns_and_seed_none_is_never_guarded():
    model = recording_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_steps(model, 2, seed=None)
        fit_steps(model, 2, seed=None)
    assert seed_warnings(caught) == []
    with pytest.warns(UserWarning, match=r"`sampling_seed` is set.*4 DP steps"):
        fit_steps(model, 1, seed=K + 1)


WORKER = r'''
import json, os, sys, warnings
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
sys.path.insert(0, os.getcwd())
import numpy as np
from tests.sampling import test_sampling_seed_guard as guard_test
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    model = guard_test.recording_model()
first = guard_test.fit_steps(model, 2)
model.save_weights(sys.argv[1])
first += guard_test.fit_steps(model, 2)
model.load_weights(sys.argv[1])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    second = guard_test.fit_steps(model, 2)
print(json.dumps({"first": first, "second": second, "warned": guard_test.seed_warnings(caught)}))
'''


def merged_steps(batches):
    """Each replica notes its own chunks: step t's rows are those of notes 2t and 2t + 1."""
    return [sorted(batches[2 * t] + batches[2 * t + 1]) for t in range(len(batches) // 2)]


def test_two_replicas_re_key_the_agreed_seed_after_a_rollback(tmp_path):
    run = subprocess.run([sys.executable, "-c", WORKER, str(tmp_path / "step2.weights.h5")], capture_output=True,
                         text=True, timeout=600, cwd=str(REPO))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    first, second = merged_steps(result["first"]), merged_steps(result["second"])
    assert first == sampler_batches(K, range(4))
    assert all(redrawn != drawn for redrawn, drawn in zip(second, first[2:]))
    assert len(result["warned"]) == 1
