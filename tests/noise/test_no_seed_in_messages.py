"""No secret seed in any message (issue 31 item 7): every error and warning the noise-key
guard (tf_dp/optimizers/key_guard.py) and the sampling-seed guard (tf_dp/sampling/seed_guard.py)
can raise, and the repr/str/get_config of the optimizer, its key guard and key, are searched for
the seed's decimal digits and its hex. Before the fix the seeded-resume refusal and the
allow_resume warning printed ``seed=<the seed>``: parsed back, it regenerated the run's noise.

The triggers, read off the two guards' code:
  key guard — a non-int seed (TypeError), a small seed (warning), a seed with secure_mode
  (ValueError), a non-bool allow_resume (TypeError), allow_resume without a seed (ValueError),
  allow_resume with a seed (warning), a seeded resume (ValueError);
  seed guard — a rollback behind drawn steps (warning), a seeded resume (warning), a non-int
  sampling seed (TypeError), a sampling seed with secure_mode (ValueError).
"""

import warnings

import keras
import numpy as np
import pytest

import tf_dp

SEED = 0x5EED_1234_ABCD_9876  # a 64-bit secret
SMALL_SEED = 0x5EED_1234  # below 2**32: warned as guessable, but still not printed


def _forms(seed: int) -> list:
    """The ways a message could spell ``seed``: decimal, hex (either case, with or without 0x)."""
    return [str(seed), f"{seed:x}", f"{seed:X}", str(seed & (2**63 - 1))]


def _assert_secret_absent(text: str, seed: int = SEED) -> None:
    for form in _forms(seed):
        assert form.lower() not in text.lower(), f"the seed ({form}) appears in: {text}"


def _captured(action, seed: int = SEED, error=None) -> list:
    """Runs ``action``; returns every warning message and the raised ``error``'s message,
    after checking that none of them (nor the exception's repr) carries ``seed``."""
    texts = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if error is None:
            action()
        else:
            with pytest.raises(error) as raised:
                action()
            texts += [str(raised.value), repr(raised.value)]
    texts += [str(w.message) for w in caught]
    for text in texts:
        _assert_secret_absent(text, seed)
    return texts


def _model(optimizer):
    inputs = keras.Input((2,))
    model = tf_dp.DPModel(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    return model


X = np.random.default_rng(0).normal(size=(32, 2)).astype("float32")
Y = np.zeros((32, 1), "float32")


def _fit(model, steps=2, **kwargs):
    model.fit(X, Y, batch_size=8, steps_per_epoch=steps, epochs=1, verbose=0, **kwargs)


def test_key_guard_argument_errors_and_warnings_never_name_the_seed():
    _captured(lambda: tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=str(SEED)), error=TypeError)
    _captured(lambda: tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=float(SEED)), error=TypeError)
    texts = _captured(lambda: tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=SMALL_SEED), seed=SMALL_SEED)
    assert any("small" in text for text in texts)  # the small-seed warning still fires
    _captured(lambda: tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=SEED, secure_mode=True), error=ValueError)
    optimizer = tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=SEED)
    _captured(lambda: optimizer.set_seed(SEED, allow_resume="yes"), error=TypeError)
    _captured(lambda: optimizer.set_seed(None, allow_resume=True), error=ValueError)
    texts = _captured(lambda: optimizer.set_seed(SEED, allow_resume=True))
    assert any("VOIDS the DP guarantee" in text for text in texts)
    _captured(lambda: optimizer.set_seed(SMALL_SEED), seed=SMALL_SEED)
    _captured(lambda: optimizer.set_seed(str(SEED)), error=TypeError)
    _assert_no_secret_in_reprs_or_config(tf_dp.DPSGD(0.1, noise_multiplier=1.0, seed=SEED))


def _assert_no_secret_in_reprs_or_config(optimizer):
    guard = optimizer._key_guard
    for text in (repr(optimizer), str(optimizer), repr(guard), str(guard), repr(guard._key), str(guard._key),
                 repr(optimizer.get_config()), repr(vars(optimizer))):
        _assert_secret_absent(text)


def test_the_seeded_resume_refusal_never_names_the_seed():
    model = _model(tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0))
    _fit(model)  # the ledger has taken 2 steps this key did not draw
    model.optimizer.seed = SEED
    texts = _captured(lambda: _fit(model), error=ValueError)
    assert any("allow_resume" in text for text in texts)


def test_sampling_seed_guard_errors_and_warnings_never_name_the_seed(tmp_path):
    model = _model(tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0))
    _captured(lambda: _fit(model, sampling_seed=str(SEED)), error=TypeError)
    _fit(model)  # 2 steps drawn from OS entropy: a seed now resumes
    texts = _captured(lambda: _fit(model, sampling_seed=SEED))
    assert any("did not draw" in text for text in texts)  # the seeded-resume warning
    path = str(tmp_path / "at_step_4.weights.h5")
    model.save_weights(path)
    _fit(model, sampling_seed=SEED)
    model.load_weights(path)
    texts = _captured(lambda: _fit(model, sampling_seed=SEED))
    assert any("generation 1" in text for text in texts)  # the rollback warning
    secure = _model(tf_dp.DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, secure_mode=True))
    _captured(lambda: _fit(secure, sampling_seed=SEED), error=ValueError)
