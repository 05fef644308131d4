"""The ``tf-dp`` command line.

    tf-dp epsilon --num_examples=60000 --batch_size=256 --noise_multiplier=1.1 --epochs=60 --delta=1e-5
    tf-dp calibrate --target_epsilon=3 --num_examples=60000 --batch_size=256 --epochs=60
    tf-dp report PATH        # a .keras file or an exported SavedModel folder (privacy.json)
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
    flags.DEFINE_float("target_epsilon", None, "Target ε (calibrate).")


COMMANDS = ("epsilon", "calibrate", "report")


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
        print(_epsilon() if command == "epsilon" else _calibrate())


def run():
    _define_flags()
    app.run(main)


if __name__ == "__main__":
    sys.exit(run())
