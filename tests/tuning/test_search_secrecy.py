"""The number of trials K stays secret: its OS-entropy seed (forced here to a recognisable
value) is in no file KerasTuner writes during the search, in no released file and in no
message; the oracle's file holds the public max_trials (None) and seed (1), and the trial
files (their count, start_order, tried_so_far: K) are deleted."""

import json
import logging
import os
import secrets
import shutil

import numpy as np
import pytest

pytest.importorskip("keras_tuner")

from tf_dp.tuning import PoissonTrials, TrialBound  # noqa: E402
from tf_dp.tuning.search import PrivateRandomSearch  # noqa: E402

from tests.tuning import _tiny  # noqa: E402

SECRET = 0x5EC2E7_0DD5_1DE_A11_C0FFEE_FACADE_BEEF  # what secrets.randbits returns (masked to its width)


def forced_randbits(bits):
    return SECRET & ((1 << bits) - 1)


class SnapshotSearch(PrivateRandomSearch):
    """Copies KerasTuner's working directory just before search() deletes it."""

    snapshot = None

    def on_search_end(self):
        super().on_search_end()
        shutil.copytree(self._workdir, self.snapshot)


def secret_spellings():
    values = {SECRET, forced_randbits(64), forced_randbits(128)}
    return {form for v in values for form in (str(v), hex(v), hex(v)[2:], f"{v:e}")}


def test_the_seed_of_k_is_in_no_artifact_and_no_message(tmp_path, monkeypatch, capfd, caplog):
    monkeypatch.setattr(secrets, "randbits", forced_randbits)
    trials = PoissonTrials(3.0).sample(np.random.default_rng(forced_randbits(128)))
    assert trials >= 2  # the forced seed draws a search with files to inspect
    x, y = _tiny.data(0)
    SnapshotSearch.snapshot = str(tmp_path / "snapshot")
    caplog.set_level(logging.DEBUG)
    tuner = SnapshotSearch(_tiny.build, distribution=PoissonTrials(3.0),
                           trial_bound=TrialBound.dp_sgd(_tiny.N, _tiny.SIGMA, _tiny.BATCH, epochs=_tiny.EPOCHS),
                           public_validation_data=_tiny.data(1))
    tuner.search(x, y, batch_size=_tiny.BATCH, epochs=_tiny.EPOCHS)
    assert len(tuner.oracle.trials) == trials  # K came from the forced OS-entropy seed
    released = tuner.release(str(tmp_path / "released"))
    assert not os.path.exists(tuner._workdir)
    with open(os.path.join(SnapshotSearch.snapshot, "search", "oracle.json")) as f:
        oracle = json.load(f)
    assert oracle.get("max_trials") is None and tuner.oracle.max_trials is None  # no cap that depends on K
    assert oracle["seed"] == 1  # KerasTuner's own seed: public, unused (draws take OS entropy)
    texts = []
    for root in (SnapshotSearch.snapshot, released):
        for folder, _, files in os.walk(root):
            for name in files:
                with open(os.path.join(folder, name), "rb") as f:
                    texts.append(f.read().decode("latin-1"))
    output = capfd.readouterr()
    texts += [output.out, output.err, caplog.text, json.dumps(tuner.privacy_report())]
    for spelling in secret_spellings():
        assert not any(spelling in text for text in texts), spelling
    assert "Trial" not in output.out + output.err  # KerasTuner's per-trial lines (their count is K) are off


def test_every_trial_builds_a_model_with_the_same_names():
    """Keras numbers auto-named objects process-wide (dense, dense_1, ...): without care, the
    released model's names would count the trials built before it."""
    names = []

    def build(hp):
        model = _tiny.build(hp)
        names.append(json.dumps(sorted(layer.name for layer in model.layers) + [model.name, model.optimizer.name]))
        return model

    class ThreeTrials(PoissonTrials):
        def sample(self, generator):
            return 3

    tuner = PrivateRandomSearch(build, distribution=ThreeTrials(3.0), public_validation_data=_tiny.data(1),
                                trial_bound=TrialBound.dp_sgd(_tiny.N, _tiny.SIGMA, _tiny.BATCH, epochs=_tiny.EPOCHS))
    names.clear()  # the builds KerasTuner makes to read the search space
    x, y = _tiny.data(0)
    tuner.search(x, y, batch_size=_tiny.BATCH, epochs=_tiny.EPOCHS)
    assert len(names) == 3 and len(set(names)) == 1, names
