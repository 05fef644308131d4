"""Accounting of banded matrix-factorization noise under cyclic Poisson sampling
(docs/algorithms.md §10 and Appendix A; "amplified BandMF", Choquette-Choo et al. 2023).

One SEGMENT — the steps run under one noise buffer and one group assignment (a new ``fit``, a
resume or a re-key starts a new one) — of T steps with b bands, rate q_b = b·L/N within the
sampled group and noise multiplier σ is accounted as

    PoissonSampled(q_b, Gaussian(σ)) self-composed ⌈T/b⌉ times.

Why: an example of group g can join only steps t ≡ g (mod b). Its participation at step t enters
the rows t … t + b − 1 of Cx (C b-banded, columns of norm ≤ 1), and the row blocks of two of its
participations never overlap; the release x + C⁻¹z is post-processing of Cx + z, so each of the
example's ≤ ⌈T/b⌉ possible participations is one Poisson-sampled Gaussian mechanism of
sensitivity ≤ C_clip at rate q_b. Segments compose like any other phases (Appendix A.2): a fresh
buffer makes C block-diagonal, each block still b-banded with column norms ≤ 1. Registered as the
event of scheme "cyclic_poisson" (``tf_dp.accounting.events``; ``import tf_dp`` imports this module).

σ changing inside a segment: the segment is accounted at the SMALLEST σ it used. Row t carries
noise of std σ_t·C_clip; with σ_min = min_t σ_t, the rows with σ_t > σ_min are the σ_min mechanism
plus independent extra noise N(0, (σ_t² − σ_min²)C_clip²) — post-processing, which cannot increase
ε. Accounting the segment's phases separately at their own σ would NOT be sound: a participation
shortly before a change of σ spans rows on both sides of it.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from dp_accounting import dp_event

from tf_dp import _checks
from tf_dp.accounting.accountant import calibrate_noise_multiplier, steps_for
from tf_dp.accounting.events import register_event


def accounted_rounds(steps: int, num_bands: int) -> int:
    """⌈T/b⌉: the most steps of a T-step segment that one example can join."""
    return math.ceil(int(steps) / int(num_bands))


def bandmf_event(sampling_rate_per_group: float, noise_multiplier: float, steps: int,
                 num_bands: int) -> dp_event.DpEvent:
    """The event of one BandMF segment: PoissonSampled(q_b, Gaussian(σ))^⌈T/b⌉ (docs/algorithms.md §10).

    Args:
      sampling_rate_per_group: q_b = b·L/N, in (0, 1].
      noise_multiplier: σ (the smallest the segment used); 0 is non-private (ε = ∞).
      steps: T, the segment's DP steps (0: no event).
      num_bands: b.

    Returns:
      A dp_accounting DpEvent.
    """
    rate = _checks.positive("sampling_rate_per_group", sampling_rate_per_group)
    if rate > 1:
        raise ValueError(f"`sampling_rate_per_group` (q_b = b·L/N) must be ≤ 1, got {rate}: lower the batch size or "
                         "the number of bands.")
    noise_multiplier = _checks.non_negative("noise_multiplier", noise_multiplier)
    num_bands = _checks.positive_int("num_bands", num_bands)
    steps = int(steps)
    if steps < 0:
        raise ValueError(f"`steps` must be ≥ 0, got {steps}.")
    if steps == 0:
        return dp_event.NoOpDpEvent()
    if noise_multiplier == 0:
        return dp_event.NonPrivateDpEvent()
    step = dp_event.PoissonSampledDpEvent(rate, dp_event.GaussianDpEvent(noise_multiplier))
    return dp_event.SelfComposedDpEvent(step, accounted_rounds(steps, num_bands))


def bandmf_segment_event(phases: Sequence) -> dp_event.DpEvent:
    """The event of ONE segment recorded as several ledger phases (σ changed inside it): all
    its steps at the smallest σ (see the module docstring for why).

    Args:
      phases: ledger phases (scheme "cyclic_poisson") of one segment, all with the same q_b and
        the same number of bands in ``parameter``.
    """
    phases = list(phases)
    if not phases:
        return dp_event.NoOpDpEvent()
    rates = {float(p.sampling_rate) for p in phases}
    bands = {int(p.parameter) for p in phases}
    if len(rates) != 1 or len(bands) != 1:
        raise ValueError(f"One BandMF segment has one q_b and one number of bands, got q_b {sorted(rates)} and "
                         f"bands {sorted(bands)}: a new sampler or privatizer starts a new segment.")
    return bandmf_event(rates.pop(), min(float(p.noise_multiplier) for p in phases),
                        sum(int(p.steps) for p in phases), bands.pop())


@register_event("cyclic_poisson", whole_segments=True)
def cyclic_poisson_phase_event(phase) -> dp_event.DpEvent:
    """The event of a "cyclic_poisson" ledger phase that is a whole segment (the accountant merges
    a segment's phases first, at the smallest σ they used: ``whole_segments``; ``parameter`` = b).

    q_b is max(the recorded rate, b·L/N): the ledger records q_b = b·L/N, and a phase that records
    L/N instead (e.g. one planned from N and L) is still accounted at b·L/N (ε grows with q).
    """
    bands = _checks.positive_int("parameter (num_bands)", int(round(float(phase.parameter))))
    rate = float(phase.sampling_rate)
    if int(phase.num_examples) > 0:
        rate = max(rate, bands * float(phase.expected_batch_size) / int(phase.num_examples))
    return bandmf_event(rate, phase.noise_multiplier, phase.steps, bands)


def calibrate_bandmf_noise_multiplier(target_epsilon: float, num_examples: int, batch_size: int, num_bands: int,
                                      epochs: Optional[float] = None, steps: Optional[int] = None,
                                      delta: float = 1e-5, accountant: str = "rdp",
                                      prior_event: Optional[dp_event.DpEvent] = None) -> float:
    """Smallest σ (0.1 % relative) whose BandMF segment of T steps, composed after ``prior_event``,
    has ε ≤ target (docs/algorithms.md §10.3, A.4).

    The segment's event PoissonSampled(q_b, G(σ))^⌈T/b⌉ is DP-SGD's event at N examples, batch
    b·L (rate q_b) and ⌈T/b⌉ steps, so this is ``calibrate_noise_multiplier`` of that problem.

    Args:
      target_epsilon, delta, accountant, prior_event: as ``calibrate_noise_multiplier``.
      num_examples, batch_size, num_bands: N, L, b (q_b = b·L/N ≤ 1).
      epochs, steps: the segment's length, ⌈epochs·N/L⌉ steps or ``steps`` (exactly one).
    """
    num_bands = _checks.positive_int("num_bands", num_bands)
    batch_size = _checks.batch_size_for(num_examples, batch_size)
    if num_bands * batch_size > num_examples:
        raise ValueError(f"num_bands={num_bands} and batch_size={batch_size} give q_b = b·L/N > 1 over "
                         f"{num_examples} examples: lower one of them.")
    total_steps = steps_for(num_examples, batch_size, epochs, steps)
    return calibrate_noise_multiplier(target_epsilon, num_examples, num_bands * batch_size,
                                      steps=accounted_rounds(total_steps, num_bands), delta=delta,
                                      accountant=accountant, prior_event=prior_event)
