"""Trains a DPModel with BackupAndRestore; used by test_resume.py (killed with SIGKILL)."""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402

backup, marker, result = sys.argv[1:4]
rng = np.random.default_rng(0)
x = rng.normal(size=(400, 6)).astype("float32")
y = (x[:, 0] > 0).astype("int32")
inputs = keras.Input((6,))
model = tf_dp.DPModel(inputs, keras.layers.Dense(2)(inputs))
model.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.2),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.optimizer.set_seed(0, allow_resume=True)  # the resumed process continues the seeded run: a lab run's opt-in


class Progress(keras.callbacks.Callback):
    """Writes the step count; slow steps let the test kill between two backups (a kill
    during Keras' own weight file write can corrupt that file, a Keras-level hazard)."""

    def on_train_batch_end(self, batch, logs=None):
        with open(marker, "w") as f:
            f.write(str(int(self.model.privacy_ledger.steps.numpy())))
        time.sleep(0.1)


model.fit(x, y, batch_size=20, epochs=4, verbose=0,
          callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=5), Progress()])
with open(result, "w") as f:
    f.write(f"{model.get_epsilon()} {int(model.privacy_ledger.steps.numpy())}")
