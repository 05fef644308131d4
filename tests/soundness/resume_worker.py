"""Trains a DPModel with BackupAndRestore; used by test_resume.py (killed with SIGKILL).

    python resume_worker.py PAUSE BACKUP MARKER RESULT [BACKUP MARKER RESULT ...]

trains once per (BACKUP, MARKER, RESULT) triple, one after the other in this process (one
TensorFlow start-up for a resumed run and an uninterrupted one), each on a model of its own,
pausing PAUSE seconds after each step (the run the test kills: > 0; the others need none).
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402


class Progress(keras.callbacks.Callback):
    """Writes the step count; slow steps let the test kill between two backups (a kill
    during Keras' own weight file write can corrupt that file, a Keras-level hazard)."""

    def __init__(self, marker, pause):
        super().__init__()
        self.marker, self.pause = marker, pause

    def on_train_batch_end(self, batch, logs=None):
        with open(self.marker, "w") as f:
            f.write(str(int(self.model.privacy_ledger.steps.numpy())))
        time.sleep(self.pause)


def train(pause, backup, marker, result):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    inputs = keras.Input((6,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(2)(inputs))
    model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.set_seed(0, allow_resume=True)  # the resumed process continues the seeded run: a lab run's opt-in
    model.fit(x, y, batch_size=20, epochs=4, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=5), Progress(marker, pause)])
    with open(result, "w") as f:
        f.write(f"{model.get_epsilon()} {int(model.privacy_ledger.steps.numpy())}")


if __name__ == "__main__":
    pause, arguments = float(sys.argv[1]), sys.argv[2:]
    for start in range(0, len(arguments), 3):
        train(pause, *arguments[start:start + 3])
