"""Why the study came out as it did: the filtered updates reimplemented from scratch in float64 numpy
(docs/algorithms.md §2–4, no tf_dp code), on a noisy quadratic whose per-coordinate signal-to-noise
ratio we control.

    f(θ) = ½ Σ_i h_i θ_i²,  h log-spaced in [h_min, 1],  θ_0 ~ N(0, I)
    ĝ_t = u_t + N(0, s² I),  u_t = c ∇f(θ_t + γ d_t) + (1 − c) ∇f(θ_t)   (two-point; c = 0: one point)

No clipping (the quadratic's gradient is the "clipped mean"; s plays σ_w = σC/L). Each method
gets the same grid (learning rate × variance floor where it has one × ω / κ where it has
one), the best final f over 3 seeds is reported per noise level s. The question: in which
SNR regime does the innovation filter + A(ω) correction help?

    python benchmarks/filtered_numpy.py            # ~1 CPU-minute
"""

from __future__ import annotations

import itertools
import json

import numpy as np

BETA_1, BETA_2, EPSILON = 0.9, 0.999, 1e-7


def ema_step(state, observation, gain):
    return (1 - gain) * state + gain * observation


def innovation_step(state, residual, observation, omega):
    residual = (1 - omega) * residual + omega * (observation - state)
    return state + residual, residual


def innovation_attenuation(omega, steps):
    """A_t of the innovation filter started at zero, by propagating the state covariance."""
    keep, covariance, values = 1 - omega, np.zeros((2, 2)), []
    transition, gain = np.array([[keep, keep], [-omega, keep]]), np.array([omega, omega])
    for _ in range(steps):
        covariance = transition @ covariance @ transition.T + np.outer(gain, gain)
        values.append(covariance[0, 0])
    return np.array(values)


def ema_attenuation(kappa, steps):
    return kappa / (2 - kappa) * (1 - (1 - kappa) ** (2 * np.arange(1, steps + 1)))


def adam_direction(m, v, t, noise_variance, floor):
    m_hat, v_hat = m / (1 - BETA_1**t), v / (1 - BETA_2**t)
    v_bar = v_hat if noise_variance is None else np.maximum(v_hat - noise_variance, floor)
    return m_hat / (np.sqrt(v_bar) + EPSILON)


def run(method: str, h: np.ndarray, noise: float, steps: int, seed: int, lr: float, floor: float = 1e-8,
        gain: float = 1.0, kappa: float = 0.7, gamma: float = 0.5) -> float:
    """Final f(θ_T) of one method; gain = ω (FIBER) or the EMA gain κ (DiSK)."""
    rng = np.random.default_rng(seed)
    theta = np.random.default_rng(1000).normal(size=h.size)
    previous, state, residual, m, v = theta.copy(), 0.0 * theta, 0.0 * theta, 0.0 * theta, 0.0 * theta
    two_point = method in ("disk", "fiber")
    c = (1 - kappa) / (kappa * gamma) if two_point else 0.0
    attenuation = (innovation_attenuation(gain, steps) if method == "fiber" else ema_attenuation(kappa, steps))
    for t in range(1, steps + 1):
        look_ahead = theta + gamma * (theta - previous)
        observation = c * h * look_ahead + (1 - c) * h * theta + rng.normal(0, noise, h.size)
        previous = theta.copy()
        if method == "sgd":  # momentum 0.9 (Keras form: velocity = 0.9·velocity − lr·g)
            m = BETA_1 * m - lr * observation
            theta = theta + m
            continue
        if method == "disk":
            state = ema_step(state, observation, kappa)
            filtered, correction = state, None
        elif method == "fiber":
            state, residual = innovation_step(state, residual, observation, gain)
            filtered, correction = state, attenuation[t - 1] * noise**2
        else:
            filtered, correction = observation, (noise**2 if method == "adambc" else None)
        m = BETA_1 * m + (1 - BETA_1) * filtered
        v = BETA_2 * v + (1 - BETA_2) * filtered**2
        theta = theta - lr * adam_direction(m, v, t, correction, floor)
    return float(0.5 * np.sum(h * theta**2)) if np.all(np.isfinite(theta)) else float("inf")


GRIDS = {
    "sgd": dict(lr=np.logspace(-3, 1, 9)),
    "adamw": dict(lr=np.logspace(-4, -1, 7)),
    "adambc": dict(lr=np.logspace(-6, -1, 11), floor=[1e-8, 1e-6, 1e-4, 1e-2, 1.0]),
    "disk": dict(lr=np.logspace(-4, -1, 7), kappa=[0.3, 0.5, 0.7, 0.9]),
    "fiber": dict(lr=np.logspace(-6, -1, 11), floor=[1e-8, 1e-6, 1e-4, 1e-2, 1.0], gain=[0.2, 0.5, 1.0]),
}


def best(method: str, h, noise, steps, seeds=3) -> tuple[float, dict]:
    grid = GRIDS[method]
    results = []
    for values in itertools.product(*grid.values()):
        config = dict(zip(grid.keys(), values))
        loss = np.mean([run(method, h, noise, steps, seed, **config) for seed in range(seeds)])
        results.append((float(loss), {k: float(v) for k, v in config.items()}))
    return min(results, key=lambda r: r[0])


def main():
    dimension, steps = 200, 300
    h = np.logspace(-2, 0, dimension)
    start = float(0.5 * np.sum(h * np.random.default_rng(1000).normal(size=dimension) ** 2))
    rows = []
    for noise in [0.01, 0.1, 1.0, 10.0]:
        row = {"noise_s": noise, "f_0": start}
        for method in GRIDS:
            row[method], row[method + "_config"] = best(method, h, noise, steps)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| s (noise per coordinate) | " + " | ".join(GRIDS) + " |")
    print("|---|" + "---|" * len(GRIDS))
    for row in rows:
        print(f"| {row['noise_s']:g} | " + " | ".join(f"{row[m]:.3g}" for m in GRIDS) + " |")


if __name__ == "__main__":
    main()
