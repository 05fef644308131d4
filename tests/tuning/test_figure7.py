"""The selection bound at the points of Papernot & Steinke's Figure 7 (ICLR 2022).

Facts from the authors' public code (tensorflow/privacy, research/hyperparameters_2022;
figure7.py and figure7_default_values.py at commit 158aba77/7eea74a6, read, not copied):

* the figure's per-trial mechanism is ONE published RDP curve (``FIGURE_RDP`` at
  ``FIGURE_ORDERS``, DP-SGD on MNIST), and its γ grid is ``GAMMAS``; Poisson uses μ = 100·γ;
* a point's x-coordinate ("Privacy budget") is min over the orders of the selection curve
  ε'(λ) — the RDP value, NOT an (ε, δ) conversion; the y-coordinate is a Monte-Carlo mean of
  accuracies from their ``lr_acc.json`` (no privacy quantity: not tested here);
* plotted: logarithmic (η = 0) at every γ; geometric (η = 1), negative binomial (η = 0.5) and
  Poisson at γ >= 1e-4 (Poisson's γ < 0.0015 are skipped; the plot window is 0.5 <= x <= 8).

``FIGURE_X`` holds those x-coordinates as the authors' functions give them (evaluated once from
their code at the published values, to 16 digits). Each is also re-derived below from the
formulas as written (``public_form``). Agreement with tf_dp (Theorem 2 for every η,
docs/algorithms.md §14):

* geometric (η = 1): the public form IS Theorem 2 with E[K] = 1/γ: equal (relative 1e-12);
* Poisson (μ >= 1): the same formula and the same δ̂ conversion: equal (relative 1e-12);
* logarithmic (η = 0) and η = 0.5: the public code writes ln((1 − γ)/γ) where Theorem 2 has
  ln(1/γ) in the λ̂ term (and, for η = 0.5, ln E[K] − ln(1 − γ) in the last), so tf_dp lies
  within ln(1/(1 − γ))·max((1 + η)/λ̂_min, 1/(λ_min − 1)) of the figure, and AT or ABOVE it
  for η = 0 (Theorem 2 is the looser, proven one); tf_dp equals Theorem 2 evaluated by hand;
* Poisson at μ = 0.15 and 0.35 (γ = 0.0015, 0.0035): the figure's x is NEGATIVE (−7.38, −3.99),
  below any Rényi divergence, so the formula bounds nothing there: tf_dp refuses μ < 1.
"""

import math

import numpy as np
import pytest

from tf_dp.tuning import PoissonTrials, TruncatedNegativeBinomial, selection_rdp

FIGURE_ORDERS = [1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5] + list(range(5, 64)) + [128, 256, 512]
FIGURE_RDP = [
    2.04459751e-01, 2.45818210e-01, 2.87335988e-01, 3.29014798e-01, 3.70856385e-01, 4.12862542e-01,
    4.97375951e-01, 5.82570265e-01, 6.68461534e-01, 7.55066706e-01, 8.42403732e-01, 1.01935100e+00,
    1.19947313e+00, 1.38297035e+00, 1.57009549e+00, 1.76124790e+00, 1.95794503e+00, 2.19017390e+00,
    4.48407479e+00, 3.08305394e+02, 4.98610133e+03, 1.11363692e+04, 1.72590079e+04, 2.33487231e+04,
    2.94091123e+04, 3.54439803e+04, 4.14567914e+04, 4.74505356e+04, 5.34277419e+04, 5.93905358e+04,
    6.53407051e+04, 7.12797586e+04, 7.72089762e+04, 8.31294496e+04, 8.90421151e+04, 9.49477802e+04,
    1.00847145e+05, 1.06740819e+05, 1.12629335e+05, 1.18513163e+05, 1.24392717e+05, 1.30268362e+05,
    1.36140424e+05, 1.42009194e+05, 1.47874932e+05, 1.53737871e+05, 1.59598221e+05, 1.65456171e+05,
    1.71311893e+05, 1.77165542e+05, 1.83017260e+05, 1.88867175e+05, 1.94715404e+05, 2.00562057e+05,
    2.06407230e+05, 2.12251015e+05, 2.18093495e+05, 2.23934746e+05, 2.29774840e+05, 2.35613842e+05,
    2.41451813e+05, 2.47288808e+05, 2.53124881e+05, 2.58960080e+05, 2.64794449e+05, 2.70628032e+05,
    2.76460867e+05, 2.82292992e+05, 2.88124440e+05, 6.66483142e+05, 1.41061455e+06, 2.89842152e+06,
]
GAMMAS = [1e-07, 8e-06, 1e-04, 0.00024, 0.0015, 0.0035, 0.025, 0.05, 0.1, 0.2, 0.5]
POISSON_FACTOR = 100  # μ = 100·γ in the figure

# x-coordinates of Figure 7's points (min over orders of ε'(λ)), by γ, per curve.
FIGURE_X = {
    "logarithmic": dict(zip(GAMMAS, [
        6.423904550799472, 5.38484761823811, 4.708327173002646, 4.453951862104686, 3.87800192664206,
        3.5945140127988022, 2.8302481652509592, 2.5203083952348933, 2.1667589798873887, 1.7404160990237423,
        0.6980964392544429])),
    "geometric": dict(zip(GAMMAS[2:], [
        7.386498732275507, 7.011297844838122, 6.149536548770319, 5.725887618576718, 4.571177079762315,
        4.091895238165494, 3.5609543071377536, 2.9410673811007673, 1.8661115198399179])),
    "negative_binomial_0.5": dict(zip(GAMMAS[2:], [
        6.116950671104787, 5.8038682957628, 5.073632936054107, 4.710976925521483, 3.736462804481656,
        3.337507893985818, 2.889364900358457, 2.362009443090233, 1.1350870612198063])),
    "poisson": dict(zip(GAMMAS[4:], [
        -7.383494563161404, -3.993602287769763, 1.384263481624687, 2.1923182447691083, 3.3900810774970314,
        5.193640347472471, 8.587200106008138])),
}


def delta_hat(epsilon_hat):
    """δ of one trial at ε̂ from its RDP curve: min over orders of exp((a−1)(r − ε̂ + ln(1−1/a)) − ln a)
    and sqrt(1 − exp(−r)) (Canonne, Kamath & Steinke's conversion, the one the figure uses)."""
    log_best = 0.0
    for a, r in zip(FIGURE_ORDERS, FIGURE_RDP):
        log_best = min(log_best, 0.5 * math.log1p(-math.exp(-r)))
        if a > 1.01:
            log_best = min(log_best, (a - 1) * (r - epsilon_hat + math.log1p(-1 / a)) - math.log(a))
    return math.exp(log_best)


def public_form(curve, gamma):
    """min_λ ε'(λ) of the figure's formula for ``curve``, re-derived from the formulas as written."""
    values = []
    for order, rdp in zip(FIGURE_ORDERS, FIGURE_RDP):
        if curve == "poisson":
            mu = POISSON_FACTOR * gamma
            values.append(rdp + mu * delta_hat(math.log1p(1 / (order - 1))) + math.log(mu) / (order - 1))
            continue
        inner = []
        for hat, rdp_hat in zip(FIGURE_ORDERS, FIGURE_RDP):
            if curve == "geometric":
                inner.append(2 * (1 - 1 / hat) * rdp_hat + (2 / hat + 1 / (order - 1)) * math.log(1 / gamma))
            elif curve == "logarithmic":
                log_odds = math.log(1 / gamma - 1)
                inner.append((1 - 1 / hat) * rdp_hat + log_odds / hat
                             + (log_odds - math.log(math.log(1 / gamma))) / (order - 1))
            else:
                eta = 0.5
                inner.append((1 + eta) * (1 - 1 / hat) * rdp_hat + (1 + eta) * math.log((1 - gamma) / gamma) / hat
                             + (math.log(1 / gamma) + math.log(eta / (1 - gamma**eta))) / (order - 1))
        values.append(rdp + min(inner))
    return min(values)


def expected_trials(eta, gamma):
    if eta == 0:
        return (1 / gamma - 1) / math.log(1 / gamma)
    return eta * (1 - gamma) / (gamma * (1 - gamma**eta))


def theorem_2(eta, gamma):
    """min_λ of Theorem 2 at the figure's curve, λ̂ over {1} ∪ the figure's orders."""
    hats = [(1.0, 0.0)] + list(zip(FIGURE_ORDERS, FIGURE_RDP))
    overhead = min((1 + eta) * ((1 - 1 / hat) * rdp_hat + math.log(1 / gamma) / hat) for hat, rdp_hat in hats)
    return min(rdp + overhead + math.log(expected_trials(eta, gamma)) / (order - 1)
               for order, rdp in zip(FIGURE_ORDERS, FIGURE_RDP))


def tf_dp_x(distribution):
    return float(np.min(selection_rdp(FIGURE_RDP, distribution, FIGURE_ORDERS)))


def test_the_figure_numbers_are_the_public_formulas():
    """The stored x-coordinates are the formulas as written (guards the transcription)."""
    for curve, points in FIGURE_X.items():
        for gamma, x in points.items():
            assert public_form(curve, gamma) == pytest.approx(x, rel=1e-12, abs=1e-12), (curve, gamma)


@pytest.mark.parametrize("gamma", GAMMAS[2:])
def test_geometric_points_match_the_figure(gamma):
    assert tf_dp_x(TruncatedNegativeBinomial(1.0, gamma)) == pytest.approx(FIGURE_X["geometric"][gamma], rel=1e-12)


@pytest.mark.parametrize("gamma", GAMMAS[6:])
def test_poisson_points_match_the_figure(gamma):
    mu = POISSON_FACTOR * gamma
    assert mu >= 1
    assert tf_dp_x(PoissonTrials(mu)) == pytest.approx(FIGURE_X["poisson"][gamma], rel=1e-12)


@pytest.mark.parametrize("gamma", GAMMAS[4:6])
def test_poisson_points_below_mean_one_are_negative_and_refused(gamma):
    """The figure's own Poisson points at μ = 0.15, 0.35 are negative (no Rényi divergence is):
    the formula is no bound there, and tf_dp refuses instead of reporting ε = 0."""
    assert FIGURE_X["poisson"][gamma] < 0
    with pytest.raises(ValueError, match="`mean`"):
        selection_rdp(FIGURE_RDP, PoissonTrials(POISSON_FACTOR * gamma), FIGURE_ORDERS)


@pytest.mark.parametrize("gamma", GAMMAS)
def test_logarithmic_points_are_theorem_2_at_or_above_the_figure(gamma):
    value = tf_dp_x(TruncatedNegativeBinomial(0.0, gamma))
    assert value == pytest.approx(theorem_2(0.0, gamma), rel=1e-12)
    figure = FIGURE_X["logarithmic"][gamma]
    assert figure - 1e-12 <= value <= figure + math.log(1 / (1 - gamma)) / FIGURE_ORDERS[0] + 1e-12


@pytest.mark.parametrize("gamma", GAMMAS[2:])
def test_negative_binomial_points_are_theorem_2_near_the_figure(gamma):
    eta = 0.5
    value = tf_dp_x(TruncatedNegativeBinomial(eta, gamma))
    assert value == pytest.approx(theorem_2(eta, gamma), rel=1e-12)
    gap = math.log(1 / (1 - gamma)) * max(1 + eta, 1 / (FIGURE_ORDERS[0] - 1))
    assert abs(value - FIGURE_X["negative_binomial_0.5"][gamma]) <= gap + 1e-12
