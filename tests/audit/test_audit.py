"""tf_dp.audit: the one-run audit (Steinke, Nasr & Jagielski 2023).

The ε conversion is checked against a brute-force evaluation of the paper's criterion;
the audit itself on real MNIST: with DP noise its lower bound stays under the
accountant's ε, without noise it lands far above the ε that σ = 1 would claim.
"""

import math

import keras
import numpy as np
import pytest

import tf_dp
from tf_dp import audit
from tf_dp.data import load_mnist

DELTA = 1e-5


# ------------------------------------------------------------- the ε conversion
def _binomial_pmf(k: int, r: int, q: float) -> float:
    return math.comb(r, k) * q**k * (1.0 - q) ** (r - k)


def _brute_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Theorem 3.1 written out term by term: P[W' ≥ v] + 2mδ·max_{i=1..m} P[v−i ≤ W' < v]/i."""
    q = math.exp(epsilon) / (1.0 + math.exp(epsilon))
    tail = sum(_binomial_pmf(k, r, q) for k in range(v, r + 1))
    window, alpha = 0.0, 0.0
    for i in range(1, m + 1):
        if v - i >= 0:
            window += _binomial_pmf(v - i, r, q)
        alpha = max(alpha, window / i)
    return min(tail + 2 * m * delta * alpha, 1.0)


def _brute_lower_bound(m: int, r: int, v: int, delta: float, beta: float, step: float = 1e-3) -> float:
    """Largest ε on a grid of ``step`` whose p-value is below β (scan up to 12)."""
    rejected = [eps for eps in np.arange(0.0, 12.0, step) if _brute_p_value(m, r, v, float(eps), delta) < beta]
    return float(rejected[-1]) if rejected else 0.0


@pytest.mark.parametrize("m, r, v, delta", [
    (60, 40, 40, 0.0), (60, 40, 33, 0.0), (60, 50, 45, 1e-3), (80, 40, 36, 1e-2), (60, 30, 22, 1e-4),
])
def test_lower_bound_matches_brute_force_criterion(m, r, v, delta):
    ours = audit.epsilon_lower_bound(r, v, delta, 0.95, canaries=m)
    assert ours == pytest.approx(_brute_lower_bound(m, r, v, delta, 0.05), abs=1.5e-3)
    if ours > 0:
        assert _brute_p_value(m, r, v, ours, delta) < 0.05 + 1e-12  # the reported ε is rejected (up to rounding)
        assert _brute_p_value(m, r, v, ours + 2e-3, delta) >= 0.05


def test_all_correct_pure_bound_has_closed_form():
    """δ = 0, v = r: q^r < β ⇔ ε < log(q*/(1−q*)), q* = β^(1/r)."""
    for r in (10, 100, 500):
        q_star = 0.05 ** (1.0 / r)
        assert audit.epsilon_lower_bound(r, r, 0.0, 0.95) == pytest.approx(math.log(q_star / (1 - q_star)), rel=1e-9)


def test_lower_bound_monotone_in_correct_and_zero_at_chance():
    bounds = [audit.epsilon_lower_bound(200, v, DELTA, 0.95, canaries=1000) for v in range(0, 201)]
    assert all(b2 >= b1 for b1, b2 in zip(bounds, bounds[1:]))
    assert bounds[:101] == [0.0] * 101  # v ≤ r/2: no better than a coin
    assert bounds[110] == 0.0  # barely above chance is not significant at 95 %
    assert bounds[200] > bounds[180] > bounds[150] > 0.0


def test_delta_term_and_confidence_only_lower_the_bound():
    pure = audit.epsilon_lower_bound(300, 280, 0.0, 0.95)
    approx = audit.epsilon_lower_bound(300, 280, 1e-4, 0.95, canaries=1000)
    assert 0.0 < approx < pure
    assert audit.epsilon_lower_bound(300, 280, 0.0, 0.99) < pure
    assert audit.epsilon_lower_bound(300, 280, 0.0, 0.95) == audit.pure_epsilon_lower_bound(300, 280, 0.95)


def test_lower_bound_is_valid_against_randomized_response():
    """ε₀-randomized response is exactly ε₀-DP: the audit exceeds ε₀ in ≤ β of the runs."""
    rng = np.random.default_rng(0)
    eps0, r, trials = 1.0, 100, 2000
    correct = rng.binomial(r, audit.randomized_response_accuracy(eps0), size=trials)
    bounds = np.array([audit.epsilon_lower_bound(r, int(v), 0.0, 0.95) for v in correct])
    assert np.mean(bounds > eps0) <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
    assert np.median(bounds) > 0.3  # and it is not vacuous


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="canaries"):
        audit.epsilon_lower_bound(10, 9, 1e-5)  # δ term needs m
    with pytest.raises(ValueError, match="correct"):
        audit.epsilon_lower_bound(10, 11)
    with pytest.raises(ValueError, match="exceed"):
        audit.epsilon_lower_bound(10, 9, 1e-5, canaries=5)
    with pytest.raises(ValueError, match="confidence"):
        audit.epsilon_lower_bound(10, 9, 0.0, 1.0)


# ------------------------------------------------------------ the audit mechanics
def test_guesses_membership_and_training_set():
    canary_x, canary_y = audit.random_pixel_canaries(400, (3,), 10, seed=0, density=None)
    one_run = audit.OneRunAudit(canary_x, canary_y, seed=1)
    assert 150 < one_run.membership.sum() < 250
    x, y = np.zeros((7, 3), np.float32), np.zeros(7, np.int32)
    x_train, y_train = one_run.training_set(x, y)
    assert len(y_train) == 7 + one_run.membership.sum()
    included = {tuple(row) for row in canary_x[one_run.membership]}
    assert {tuple(row) for row in x_train[np.any(x_train != 0, axis=1)]} == included

    scores = np.where(one_run.membership, 1.0, -1.0) + np.random.default_rng(2).normal(0, 0.1, 400)
    guesses = audit.guess_membership(scores, 50, 30)
    assert (guesses == 1).sum() == 50 and (guesses == -1).sum() == 30
    result = one_run.evaluate(scores, k_pos=50, k_neg=30, delta=DELTA)
    assert (result.guesses, result.correct) == (80, 80)
    assert result.epsilon_lower_bound == audit.epsilon_lower_bound(80, 80, DELTA, canaries=400)
    shuffled = one_run.evaluate(np.random.default_rng(3).normal(size=400), k_pos=50, k_neg=50, delta=DELTA)
    assert shuffled.epsilon_lower_bound == 0.0  # scores unrelated to S
    best = one_run.evaluate_best(scores, [(10, 10), (50, 50), (100, 100)], delta=DELTA)
    assert best.confidence == pytest.approx(1 - 0.05 / 3)
    with pytest.raises(ValueError, match="exceed"):
        one_run.evaluate(scores, k_pos=300, k_neg=200, delta=DELTA)


def test_mislabeled_canaries_never_keep_their_label():
    x, y = np.arange(50, dtype=np.float32)[:, None], np.arange(50, dtype=np.int32) % 10
    x_rest, y_rest, canary_x, canary_y = audit.mislabeled_canaries(x, y, 20, 10, seed=0)
    assert len(x_rest) == 30 and len(canary_x) == 20
    assert not np.any(canary_y == canary_x[:, 0].astype(np.int32) % 10)
    assert set(x_rest[:, 0]).isdisjoint(canary_x[:, 0])


# --------------------------------------------------- one training run on real MNIST
REAL_EXAMPLES, CANARIES, BATCH, EPOCHS, LEARNING_RATE = 2000, 1000, 10, 10, 0.2
K = CANARIES // 10  # run()'s default k₊ = k₋ = ⌊m/10⌋


@pytest.fixture(scope="module")
def mnist_audit():
    data = load_mnist(flatten=True)
    canary_x, canary_y = audit.random_pixel_canaries(CANARIES, (784,), 10, seed=1)
    return data.x_train[:REAL_EXAMPLES], data.y_train[:REAL_EXAMPLES], audit.OneRunAudit(canary_x, canary_y, seed=2)


def _audit(mnist_audit, noise_multiplier: float, clip: float):
    """Logistic regression, DP-SGD with Poisson L = 10 for 10 epochs; one audit, k₊ = k₋ = 100."""
    x, y, one_run = mnist_audit
    seen = {}

    def train(x_train, y_train):
        inputs = keras.Input((784,))
        model = tf_dp.DPModel(inputs, keras.layers.Dense(10)(inputs))
        model.compile(
            optimizer=tf_dp.DPSGD(LEARNING_RATE, l2_norm_clip=clip, noise_multiplier=noise_multiplier, seed=3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), delta=DELTA,
        )
        model.fit(x_train, y_train, batch_size=BATCH, epochs=EPOCHS, sampling_seed=4, verbose=0)
        seen.update(examples=len(y_train), steps=int(model.privacy_ledger.steps.numpy()))
        return model

    result = one_run.run(train, x, y, delta=DELTA)
    claimed = tf_dp.compute_epsilon(seen["examples"], BATCH, 1.0, steps=seen["steps"], delta=DELTA)
    print(f"\nσ = {noise_multiplier}, C = {clip}, N = {seen['examples']}, steps = {seen['steps']}: "
          f"{result.summary()}; ε claimed at σ = 1: {claimed:.3f}")
    return result, claimed


def test_audit_with_dp_noise_stays_below_the_accountant(mnist_audit):
    result, claimed = _audit(mnist_audit, noise_multiplier=1.0, clip=1.0)
    assert result.guesses == 2 * K and result.canaries == CANARIES
    assert result.accountant_epsilon == pytest.approx(claimed, rel=1e-6)
    assert 0.0 <= result.epsilon_lower_bound <= result.accountant_epsilon


def test_audit_without_noise_exceeds_the_claim_it_would_make_with_noise(mnist_audit):
    result, claimed = _audit(mnist_audit, noise_multiplier=0.0, clip=100.0)
    assert math.isinf(result.accountant_epsilon)  # σ = 0 is accounted as non-private
    assert result.correct >= 0.95 * result.guesses
    assert result.epsilon_lower_bound > 3.0
    assert result.epsilon_lower_bound > 2.0 * claimed  # σ = 1 would claim ε ≈ 1.3 for this run
