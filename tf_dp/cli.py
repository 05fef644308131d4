"""The ``tf-dp`` command line.

    tf-dp epsilon --num_examples=60000 --batch_size=256 --noise_multiplier=1.1 --epochs=60 --delta=1e-5
    tf-dp calibrate --target_epsilon=3 --num_examples=60000 --batch_size=256 --epochs=60
    tf-dp report PATH        # a .keras file or an exported SavedModel folder (privacy.json)
    tf-dp tune --dataset=adult --target_epsilon=3 --output=tuned   # private random search (tf_dp.tuning)
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # the accountant needs no TensorFlow logging

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def _define_flags() -> None:
    """The command's flags, defined when the command runs (not at import: ``report`` is a library
    function too, and absl's flags are one global table another program may fill)."""
    if "num_examples" in FLAGS:
        return
    flags.DEFINE_integer("num_examples", None, "N, the number of training examples.")
    flags.DEFINE_integer("batch_size", None, "L, the expected Poisson batch size.")
    flags.DEFINE_float("noise_multiplier", None, "σ.")
    flags.DEFINE_float("epochs", None, "Epochs (T = ⌈epochs·N/L⌉ steps); or --steps.")
    flags.DEFINE_integer("steps", None, "Number of steps T; or --epochs.")
    flags.DEFINE_float("delta", 1e-5, "δ.")
    flags.DEFINE_enum("accountant", "rdp", ["rdp", "pld"], "Accountant.")
    flags.DEFINE_float("target_epsilon", None, "Target ε (calibrate; tune: the whole search's ε).")
    _define_tune_flags()


def _define_tune_flags() -> None:
    """Flags of ``tf-dp tune`` (docs/guides/tuning.md)."""
    flags.DEFINE_enum("dataset", "adult", ["adult", "mnist"], "tune: Adult (logistic regression) or MNIST (the "
                      "main job's scattering CNN).")
    flags.DEFINE_string("output", None, "tune: directory of the released model.keras and privacy.json.")
    flags.DEFINE_enum("trials", "logarithmic", ["logarithmic", "geometric", "poisson"],
                      "tune: the law of the (secret) number of trials K.")
    flags.DEFINE_float("mean_trials", 10.0, "tune: E[K].")
    flags.DEFINE_list("learning_rates", None, "tune: candidate learning rates (default: the data set's).")
    flags.DEFINE_list("clip_norms", None, "tune: candidate clip norms (default: the data set's).")
    flags.DEFINE_integer("train_examples", None, "tune: training rows (default: all but the validation rows).")
    flags.DEFINE_integer("validation_examples", 2000, "tune: private validation rows that rank the trials.")
    flags.DEFINE_float("score_noise", 30.0, "tune: σ of the noise on each trial's validation count.")


COMMANDS = ("epsilon", "calibrate", "report", "tune")


def _require(*names):
    missing = [n for n in names if getattr(FLAGS, n) is None]
    if missing:
        raise app.UsageError(f"missing flag(s): {', '.join('--' + n for n in missing)}")
    if (FLAGS.epochs is None) == (FLAGS.steps is None):
        raise app.UsageError("pass exactly one of --epochs or --steps")


def _epsilon() -> str:
    from tf_dp.accounting import compute_epsilon

    _require("num_examples", "batch_size", "noise_multiplier")
    value = compute_epsilon(FLAGS.num_examples, FLAGS.batch_size, FLAGS.noise_multiplier, epochs=FLAGS.epochs,
                            steps=FLAGS.steps, delta=FLAGS.delta, accountant=FLAGS.accountant)
    return f"{value:.3f}"


def _calibrate() -> str:
    from tf_dp.accounting import calibrate_noise_multiplier

    _require("target_epsilon", "num_examples", "batch_size")
    value = calibrate_noise_multiplier(FLAGS.target_epsilon, FLAGS.num_examples, FLAGS.batch_size,
                                       epochs=FLAGS.epochs, steps=FLAGS.steps, delta=FLAGS.delta,
                                       accountant=FLAGS.accountant)
    return f"{value:.4f}"


def _tune() -> str:
    """Runs the private random search; the printed lines state the search's ε, never K or a seed."""
    from tf_dp.tuning.command import tune

    if FLAGS.output is None:
        raise app.UsageError("missing flag: --output (directory of the released model and privacy.json)")
    if FLAGS.steps is not None or (FLAGS.epochs is not None and not float(FLAGS.epochs).is_integer()):
        raise app.UsageError("tune takes a whole number of --epochs (not --steps)")
    floats = lambda values: None if values is None else [float(v) for v in values]  # noqa: E731
    result = tune(FLAGS.dataset, FLAGS.output, target_epsilon=FLAGS.target_epsilon,
                  noise_multiplier=FLAGS.noise_multiplier, distribution=FLAGS.trials, mean_trials=FLAGS.mean_trials,
                  learning_rates=floats(FLAGS.learning_rates), clip_norms=floats(FLAGS.clip_norms),
                  batch_size=FLAGS.batch_size, epochs=None if FLAGS.epochs is None else int(FLAGS.epochs),
                  train_examples=FLAGS.train_examples, validation_examples=FLAGS.validation_examples,
                  score_noise=FLAGS.score_noise, delta=FLAGS.delta)
    best = ", ".join(f"{k} = {v:g}" for k, v in sorted(result.hyperparameters.items()))
    return "\n".join([
        f"tuning: epsilon = {result.epsilon:.4f} at delta = {result.delta:g} (RDP), the whole search "
        f"(K ~ {FLAGS.trials}, E[K] = {FLAGS.mean_trials:g}); one trial alone: {result.epsilon_one_trial:.4f}",
        f"sigma per trial = {result.noise_multiplier:.4f}",
        f"best trial: test accuracy = {result.test_accuracy:.4f} ({best})",
        f"released: {os.path.join(result.directory, 'model.keras')}, {os.path.join(result.directory, 'privacy.json')}",
    ])


def report(path: str) -> dict:
    """The privacy ledger of a saved model: privacy.json of an export, or a .keras file."""
    ledger_file = os.path.join(path, "privacy.json") if os.path.isdir(path) else None
    if ledger_file and os.path.exists(ledger_file):
        with open(ledger_file) as f:
            return json.load(f)
    if path.endswith(".keras") and os.path.exists(path):
        import keras

        import tf_dp  # noqa: F401  (registers the DP classes)

        model = keras.models.load_model(path, compile=False)  # the ledger needs no loss or optimizer
        if not hasattr(model, "privacy_report"):
            raise app.UsageError(f"{path} is not a tf_dp model: it has no privacy ledger")
        settings = _saved_privacy_settings(path)
        for name in ("delta", "accountant"):
            if name in settings:
                model._dp[name] = settings[name]
        return model.privacy_report()
    raise app.UsageError(f"{path}: expected a .keras file or an exported folder containing privacy.json")


def _saved_privacy_settings(path: str) -> dict:
    """δ and accountant chosen at compile time, read from the .keras file's config."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        config = json.loads(archive.read("config.json"))
    return (config.get("compile_config") or {}).get("privacy", {})


def _format_report(data: dict) -> str:
    lines = [f"epsilon = {data['epsilon']:.4f} at delta = {data['delta']:g} ({data['accountant'].upper()}), "
             f"{data['steps']} steps"]
    for p in data["phases"]:
        extra = f", parameter {p['parameter']:g}" if p.get("parameter") else ""
        lines.append(f"  {p['steps']} steps, sampling={p['scheme']}, q={p['sampling_rate']:.6g}, "
                     f"sigma={p['noise_multiplier']:.6g}, N={p['num_examples']}, L={p['expected_batch_size']:g}{extra}")
    return "\n".join(lines)


def main(argv):
    if len(argv) < 2 or argv[1] not in COMMANDS:
        raise app.UsageError(f"usage: tf-dp {{{'|'.join(COMMANDS)}}} [flags]")
    command = argv[1]
    if command == "report":
        if len(argv) != 3:
            raise app.UsageError("usage: tf-dp report PATH")
        print(_format_report(report(argv[2])))
    elif len(argv) > 2:
        raise app.UsageError(f"unexpected arguments: {argv[2:]}")
    else:
        print({"epsilon": _epsilon, "calibrate": _calibrate, "tune": _tune}[command]())


def run():
    _define_flags()
    app.run(main)


if __name__ == "__main__":
    sys.exit(run())
