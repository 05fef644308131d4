"""Privatizers: how one step's clipped sum becomes a noisy sum (docs/algorithms.md §1 step 4, §10).

A privatizer is one part of the DP mechanism, chosen by the optimizer's ``noise=`` argument
(``tf_dp.DPSGD(..., noise=tf_dp.noise.BandMF(4))``; default ``GaussianNoise()``). It owns
whatever secret state its noise needs (BandMF's buffer of past draws) and keeps it out of
every artifact: such state lives in ``tf.Variable``s held by a plain Python object (not a
``tf.Module``, not a Keras layer or optimizer attribute that savers track), like
``tf_dp.noise.NoiseKey``. It names the sampling scheme it needs (``required_sampling``), so
that ``fit`` draws batches the ledger can account for it, and the scheme's accounting event
is the accountant's business (``tf_dp.accounting``), never the privatizer's.

Add a privatizer: subclass ``Privatizer``, implement ``privatize``, decorate the class with
``@register_privatizer("name")`` (which also makes it Keras-serializable in an optimizer's
config), and test it against an independent computation (docs/design.md).
"""

from __future__ import annotations

from typing import Optional, Sequence

import keras
import tensorflow as tf

from tf_dp import _checks

from tf_dp.noise.gaussian import add_gaussian_noise

PRIVATIZERS: dict = {}


def register_privatizer(name: str):
    """Class decorator: registers a Privatizer under ``name`` (``noise="name"`` resolves to it)."""
    def register(cls):
        if name in PRIVATIZERS and PRIVATIZERS[name] is not cls:
            raise ValueError(f"A privatizer named {name!r} is already registered ({PRIVATIZERS[name].__name__}).")
        PRIVATIZERS[name] = cls
        return keras.saving.register_keras_serializable(package="tf_dp")(cls)
    return register


class Privatizer:
    """Base class: turns Σ_i ḡ_i of one step into the released noisy sum.

    Subclasses implement ``privatize``; stateful ones also ``build`` and ``reset``.
    """

    #: The sampling scheme ``fit`` must use with this privatizer (a name the sampling and
    #: accounting registries know, e.g. "cyclic_poisson"), or None for any scheme.
    required_sampling: Optional[str] = None

    def build(self, variables: Sequence) -> None:
        """Creates the secret state for ``variables`` (the trainable variables, in order).
        Called once, eagerly, before the train step is traced."""

    def reset(self, dp_step: int = 0) -> None:
        """Starts a fresh secret state (a new segment: a new fit's sampler, a re-key, a resume).

        Args:
          dp_step: the ledger's step count at the reset (a resumed model has steps > 0).
        """

    def privatize(self, clipped_sums: Sequence[tf.Tensor], stddev: tf.Tensor, key: tf.Tensor, dp_step: tf.Tensor,
                  replica=0, replicas: int = 1) -> list:
        """Returns the noisy sums, one per variable.

        Args:
          clipped_sums: Σ_i ḡ_i per trainable variable (each ḡ_i of norm ≤ C overall).
          stddev: σ·C, the standard deviation of the fresh Gaussian draw z_t on the sum.
          key: the run's secret Philox key (int64 scalar).
          dp_step: the ledger's DP step count before this step: the noise counter.
          replica, replicas: under tf.distribute, this replica and the replica count; each
            replica adds a share (the caller has scaled ``stddev`` by 1/√R).
        """
        raise NotImplementedError

    def sampling_arguments(self) -> dict:
        """Arguments the required sampling scheme takes from this privatizer (BandMF: bands)."""
        return {}

    #: Whether the released noise is independent across steps (filters' corrections assume it).
    white_noise = True

    def noise_variance_factor(self) -> tf.Tensor:
        """Per-coordinate variance of the latest step's released noise per unit of stddev²
        (1 for white Gaussian noise; BandMF: docs/algorithms.md §10.5). Float32 scalar."""
        return tf.constant(1.0, tf.float32)

    def noise_recursion(self):
        """Correlated noise's recursion c_0 w_t = ζ_t − Σ_{j≥1} c_j w_{t−j} as (c_0, …, c_{b−1}),
        which lets a filter track the noise it leaves (docs/algorithms.md §10.6); None for white
        noise (or a correlated privatizer that does not state one)."""
        return None

    def segment_restarted(self) -> tf.Tensor:
        """Whether the latest step's noise started a new segment, independent of all earlier
        noise (bool scalar; always False for white noise, whose steps are all independent)."""
        return tf.constant(False)

    def released_noise_variance(self, variance: tf.Tensor) -> tf.Tensor:
        """The latest step's per-coordinate noise variance, given stddev² as ``variance``:
        ``variance`` · noise_variance_factor(). White noise: ``variance`` itself, no op added
        to the step; BandMF multiplies by F_n (docs/algorithms.md §10.5)."""
        if self.white_noise:
            return variance
        return variance * tf.cast(self.noise_variance_factor(), variance.dtype)

    def get_config(self) -> dict:
        return {}

    @classmethod
    def from_config(cls, config: dict):
        return cls(**config)


@register_privatizer("gaussian")
class GaussianNoise(Privatizer):
    """DP-SGD's noise: x_t + z_t, z_t ~ N(0, σ²C² I) independent across steps (docs/algorithms.md §1)."""

    def privatize(self, clipped_sums, stddev, key, dp_step, replica=0, replicas=1):
        return add_gaussian_noise(list(clipped_sums), stddev, key, dp_step, replica, replicas)

    def __repr__(self) -> str:
        return "GaussianNoise()"


def resolve_privatizer(noise) -> Privatizer:
    """``noise=`` of a DP optimizer: None or "gaussian" → GaussianNoise(), a registered name,
    a Privatizer, or a serialized one (a config dict)."""
    return _checks.registered_part("noise", noise, PRIVATIZERS, Privatizer, GaussianNoise,
                                   "a tf_dp.noise.Privatizer (e.g. tf_dp.noise.BandMF(4))")
