"""RaCO-DP as a plug-in of the DP step (docs/design.md, docs/algorithms.md §5).

The core (tf_dp/models, tf_dp/noise, the ledger) holds no RaCO-DP code and no hook for it to
override; RaCO-DP's per-example Lagrangian term is a PerExampleObjective passed to the step,
its group ids travel as fit's per_example_extras, and nothing is parked on the model. The
σ = 0 release of one RaCO-DP step is compared with an independent per-example loop, and a
model saved by main before this part loads and continues exactly as main continued it.
"""

import ast
import inspect
import json
import pathlib
import re
import textwrap
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.harness import reference_steps
from tf_dp.models.dp_model import DPModel
from tf_dp.models.objective import COMPILED_LOSS, PerExampleObjective
from tf_dp.models.plan import StepPlan
from tf_dp.models.step import DPTrainStep
from tf_dp.raco import DemographicParity, RateConstrainedModel

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE = [*sorted((ROOT / "tf_dp" / "models").glob("*.py")), *sorted((ROOT / "tf_dp" / "noise").glob("*.py")),
        ROOT / "tf_dp" / "accounting" / "ledger.py"]
# "histogram" alone also names the image histogram of Keras' Equalization layer (validation.py's
# refusal message), which is not RaCO-DP's: its histogram is matched by RaCO-DP's own names.
RACO_WORDS = re.compile(r"raco|lagrang|rate.?constrain|noisy.?histogram|histogram.?noise|NoisyHistogram",
                        re.IGNORECASE)
SAVED_BY_MAIN = ROOT / "tests" / "data" / "raco_main"


def _code_without_comments_or_docstrings(path: pathlib.Path) -> str:
    """The module's code as Python sees it: ast.unparse drops comments; docstrings removed."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.unparse(tree)


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_core_names_no_raco_concept_in_code(path):
    """tf_dp/models, tf_dp/noise and the ledger: comments and docstrings may cite RaCO-DP, code may not."""
    hits = sorted({m.group(0) for m in RACO_WORDS.finditer(_code_without_comments_or_docstrings(path))})
    assert not hits, f"{path.relative_to(ROOT)} names {hits} in code"


def test_dp_model_has_no_hooks_for_a_subclass_to_override():
    for hook in ("_chunk_loss", "_targets", "_per_example_extras"):
        assert not hasattr(DPModel, hook), hook
    overridden = sorted(name for name in vars(RateConstrainedModel)
                        if name.startswith("_") and not name.startswith("__") and hasattr(DPModel, name))
    assert overridden == [], f"RateConstrainedModel overrides private DPModel methods {overridden}"


def _assignments_to_self(function) -> list:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    targets = [t for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign))
               for t in (node.targets if isinstance(node, ast.Assign) else [node.target])]
    return sorted(ast.unparse(t) for t in targets for t in ast.walk(t)
                  if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self")


@pytest.mark.parametrize("function", [RateConstrainedModel.train_step, RateConstrainedModel.fit,
                                      DPTrainStep._dp_step, DPTrainStep._clip_chunk],
                         ids=lambda f: f.__qualname__)
def test_state_is_passed_not_parked_on_the_model(function):
    """Nothing is assigned to the model between building a value of the step and using it."""
    assert _assignments_to_self(function) == []


# --------------------------------------------------------------- one step, by hand
ROWS, FEATURES, CLIP, LEARNING_RATE = 12, 4, 0.5, 0.5
RNG = np.random.default_rng(3)
X = RNG.normal(size=(ROWS, FEATURES)).astype("float32")
Y = RNG.integers(0, 2, ROWS).astype("int32")
GROUPS = np.array([0] * 5 + [1] * 7, "int32")
MULTIPLIERS = np.array([0.7, 0.0, 0.2, 1.3], "float32")  # λ of DemographicParity's (group z, class k) rows


def _raco_model(engine):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    model = RateConstrainedModel(inputs, keras.layers.Dense(2, activation="softmax")(inputs))
    model.compile(optimizer=tf_dp.DPSGD(LEARNING_RATE, l2_norm_clip=CLIP, noise_multiplier=0.0, seed=1),
                  loss="sparse_categorical_crossentropy", constraints=[DemographicParity(0.01)], num_groups=2,
                  histogram_noise=1e-6, dual_learning_rate=1.0, clipping_engine=engine)
    model.multipliers.assign(MULTIPLIERS)
    return model


def _hand_step(model, expected_batch_size):
    """θ − η/L · Σ_i clip_C(∇(ℓ_i + L·Σ_k W[z_i, k]·p_k(x_i))), W of DemographicParity by hand:
    Γ_{z,k} = H[z,k]/N_z − H[1−z,k]/N_{1−z}, so W[z, k] = (λ_{z,k} − λ_{1−z,k}) / N_z, N_z the
    group's count (Σ_k p_k = 1; the histogram's Laplace noise is 1e-6)."""
    counts = np.bincount(GROUPS, minlength=2).astype("float64")
    lam = MULTIPLIERS.reshape(2, 2)
    weights = np.stack([(lam[z] - lam[1 - z]) / counts[z] for z in range(2)]).astype("float32")
    total = [np.zeros(v.shape, "float64") for v in model.trainable_variables]
    for i in range(ROWS):
        with tf.GradientTape() as tape:
            p = model(X[i:i + 1], training=True)[0]
            loss = -tf.math.log(p[Y[i]])
            term = loss + expected_batch_size * tf.reduce_sum(weights[GROUPS[i]] * p)
        grads = [g.numpy().astype("float64") for g in tape.gradient(term, model.trainable_variables)]
        norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
        total = [t + g * min(1.0, CLIP / norm) for t, g in zip(total, grads)]
    return [v.numpy() - LEARNING_RATE * t / expected_batch_size for v, t in zip(model.trainable_variables, total)]


def _poisson_batch(expected_batch_size):
    return {"x": tf.constant(X[None]), "y": tf.constant(Y[None]), "groups": tf.constant(GROUPS[None]),
            "mask": tf.ones([1, ROWS]), "expected_batch_size": tf.constant([expected_batch_size], tf.int64)}


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
def test_sigma_zero_release_of_one_step_is_the_per_example_loop_of_clipped_lagrangian_terms(engine):
    expected_batch_size = 10  # L ≠ the batch's size: the term's factor is the public L
    model = _raco_model(engine)
    expected = _hand_step(model, expected_batch_size)
    with reference_steps(model):
        model.train_step(_poisson_batch(expected_batch_size))
    for got, want in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
    unconstrained = _raco_model(engine)
    unconstrained.multipliers.assign(np.zeros(4, "float32"))
    with reference_steps(unconstrained):
        unconstrained.train_step(_poisson_batch(expected_batch_size))
    moved = max(float(np.max(np.abs(a.numpy() - b))) for a, b in zip(unconstrained.trainable_variables, expected))
    assert moved > 1e-3  # the Lagrangian term changed the release: the comparison can fail


# ------------------------------------------------------------ the part itself
def test_the_compiled_loss_is_the_default_objective():
    def compiled(y, p):
        return y + p

    assert COMPILED_LOSS.per_example_loss(compiled) is compiled
    y = tf.constant([[1, 5], [0, 6]])
    np.testing.assert_array_equal(COMPILED_LOSS.labels_of(y), y)
    custom = PerExampleObjective(loss=lambda y, p: 2 * compiled(y, p), labels=lambda packed: packed[..., 0])
    assert custom.per_example_loss(compiled) is custom.loss
    np.testing.assert_array_equal(custom.labels_of(y), [1, 0])
    with pytest.raises(TypeError, match="`loss` must be a callable"):
        PerExampleObjective(loss=2.0)


def test_per_example_extras_are_plan_data_compared_by_name():
    groups = np.zeros(4, "int32")
    plan = StepPlan(per_example_extras={"groups": groups})
    assert plan.extra_names == ("groups",)
    assert plan == StepPlan(per_example_extras={"groups": groups + 1})  # data: no retrace
    assert plan != StepPlan()  # a new column: a new batch structure, a new trace
    with pytest.raises(ValueError, match="per_example_extras` name 'mask'"):
        StepPlan(per_example_extras={"mask": groups})


def test_fit_refuses_per_example_extras_it_cannot_carry():
    inputs = keras.Input((FEATURES,))
    plain = tf_dp.DPModel(inputs, keras.layers.Dense(2)(inputs))
    plain.compile(optimizer=tf_dp.DPSGD(0.1, noise_multiplier=1.0), loss="sparse_categorical_crossentropy")
    with pytest.raises(ValueError, match="per_example_extras` are read by a train step"):
        plain.fit(X, Y, batch_size=4, verbose=0, per_example_extras={"groups": GROUPS})
    model = _raco_model("ghost")
    with pytest.raises(ValueError, match="pass no `per_example_extras`"):
        model.fit(X, Y, groups=GROUPS, batch_size=4, verbose=0, per_example_extras={"groups": GROUPS})
    with pytest.raises(ValueError, match=r"per_example_extras\['g'\]` needs one row per training example"):
        DPModel.fit(model, X, Y, batch_size=4, verbose=0, per_example_extras={"g": GROUPS[:5]})


def test_fit_carries_the_groups_of_the_training_part_and_logs_the_multipliers():
    model = _raco_model("ghost")
    seen = keras.callbacks.History()
    history = model.fit(X, Y, groups=GROUPS, batch_size=6, epochs=2, verbose=0, sampling_seed=0, callbacks=[seen])
    assert "lambda_0" in seen.history and "max_violation" in history.history  # before the user's callbacks
    assert model.step_plan.per_example_extras is None  # the fit's plan ends with the fit


# ------------------------------------------------- a model saved by main still continues
def test_a_model_saved_by_main_loads_and_continues_as_main_continued_it():
    """tests/data/raco_main (README.md there): saved by main before the objective part, and
    main's own continuation of it (noise keyed by a lab seed, 4 more steps)."""
    expected = json.loads((SAVED_BY_MAIN / "expected.json").read_text())
    x, y, z = _fixture_data()
    loaded = keras.models.load_model(SAVED_BY_MAIN / "model.keras")
    assert int(loaded.privacy_ledger.steps.numpy()) == expected["saved"]["steps"]
    np.testing.assert_array_equal(loaded.multipliers.numpy(), expected["saved"]["multipliers"])
    assert loaded.get_epsilon() == pytest.approx(expected["saved"]["epsilon"], rel=1e-9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # allow_resume's warning: a lab run
        loaded.optimizer.set_seed(7, allow_resume=True)
        loaded.fit(x, y, groups=z, batch_size=50, epochs=1, verbose=0, sampling_seed=1)
    continued = expected["continued"]
    assert int(loaded.privacy_ledger.steps.numpy()) == continued["steps"]
    np.testing.assert_allclose(loaded.multipliers.numpy(), continued["multipliers"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loaded.constraint_values.numpy(), continued["constraint_values"], rtol=1e-5,
                               atol=1e-6)
    for got, want in zip(loaded.get_weights(), continued["weights"]):
        np.testing.assert_allclose(got, np.asarray(want, "float32"), rtol=1e-5, atol=1e-6)
    assert loaded.get_epsilon() == pytest.approx(continued["epsilon"], rel=1e-9)


def _fixture_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3)).astype("float32")
    return x, (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32"), (x[:, 1] > 0).astype("int32")
