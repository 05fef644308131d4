"""Rate constraints read off a (noisy) per-(partition, class) histogram (docs/algorithms.md §5).

Partition q of an example is its group z, or (z, y) when a constraint needs labels. With
Ĥ[q, k] the histogram of softmax mass and N̂_q = Σ_k Ĥ[q, k], every constraint is a sum of
rate terms over unions S of partitions:

    Γ_j = Σ_t coef_t · Ĥ[S_t, k_t] / N̂_{S_t} ≤ γ_j,   Ĥ[S, k] = Σ_{q∈S} Ĥ[q, k].

All of it is post-processing of Ĥ: N̂ comes from Ĥ, never from raw counts.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_dp import _checks


@dataclass(frozen=True)
class RateTerm:
    """coefficient · (rate of predicting ``label`` among examples in ``partitions``)."""

    partitions: tuple
    label: int
    coefficient: float


class Constraint(abc.ABC):
    """A family of rate constraints; compiled against the number of groups and classes."""

    needs_labels = False

    @abc.abstractmethod
    def expand(self, num_groups: int, num_classes: int, partition) -> list[tuple[str, list[RateTerm], float]]:
        """[(name, terms, bound)], with ``partition(group, label)`` giving partition ids."""

    def get_config(self) -> dict:
        return dict(self._config)

    @classmethod
    def from_config(cls, config):
        return cls(**config)


def _two_sided_gap(name, members_of, others_of, units, num_classes, bound):
    rows = []
    for unit in units:
        for k in range(num_classes):
            terms = [RateTerm(members_of(unit), k, 1.0), RateTerm(others_of(unit), k, -1.0)]
            rows.append((f"{name}[{unit}, class {k}]", terms, bound))
    return rows


@keras.saving.register_keras_serializable(package="tf_dp")
class DemographicParity(Constraint):
    """P(ŷ = k | z) − P(ŷ = k | not z) ≤ max_gap for every group z and class k (both signs
    appear across classes, so for binary tasks this bounds the absolute gap).

    Args:
      max_gap: γ ≥ 0, the allowed rate gap.
    """

    def __init__(self, max_gap: float):
        self.max_gap = _checks.non_negative("max_gap", max_gap, "It is the allowed rate gap γ.")
        self._config = {"max_gap": self.max_gap}

    def expand(self, num_groups, num_classes, partition):
        labels = range(num_classes) if self.needs_labels_of_partition(partition) else [None]
        members = lambda z: tuple(partition(z, y) for y in labels)  # noqa: E731
        others = lambda z: tuple(partition(o, y) for o in range(num_groups) if o != z for y in labels)  # noqa: E731
        return _two_sided_gap("demographic_parity", members, others, range(num_groups), num_classes, self.max_gap)

    @staticmethod
    def needs_labels_of_partition(partition) -> bool:
        return getattr(partition, "label_aware", False)


@keras.saving.register_keras_serializable(package="tf_dp")
class EqualizedOdds(Constraint):
    """P(ŷ = k | z, y) − P(ŷ = k | not z, y) ≤ max_gap for every true label y, group z, class k.

    Args:
      max_gap: γ ≥ 0, the allowed rate gap.
    """

    needs_labels = True

    def __init__(self, max_gap: float):
        self.max_gap = _checks.non_negative("max_gap", max_gap, "It is the allowed rate gap γ.")
        self._config = {"max_gap": self.max_gap}

    def expand(self, num_groups, num_classes, partition):
        units = [(z, y) for y in range(num_classes) for z in range(num_groups)]
        members = lambda u: (partition(u[0], u[1]),)  # noqa: E731
        others = lambda u: tuple(partition(o, u[1]) for o in range(num_groups) if o != u[0])  # noqa: E731
        return _two_sided_gap("equalized_odds", members, others, units, num_classes, self.max_gap)


@keras.saving.register_keras_serializable(package="tf_dp")
class FalseNegativeRate(Constraint):
    """P(ŷ ≠ positive | z, y = positive) ≤ max_rate for every group z.

    Args:
      max_rate: the allowed false-negative rate (≥ 0).
      positive_class: the index of the positive class.
    """

    needs_labels = True

    def __init__(self, max_rate: float, positive_class: int = 1):
        self.max_rate = _checks.non_negative("max_rate", max_rate)
        self.positive_class = int(positive_class)
        self._config = {"max_rate": self.max_rate, "positive_class": self.positive_class}

    def expand(self, num_groups, num_classes, partition):
        if not 0 <= self.positive_class < num_classes:
            raise ValueError(f"`positive_class`={self.positive_class} is not a class of a {num_classes}-class model.")
        rows = []
        for z in range(num_groups):
            cell = (partition(z, self.positive_class),)
            terms = [RateTerm(cell, k, 1.0) for k in range(num_classes) if k != self.positive_class]
            rows.append((f"false_negative_rate[group {z}]", terms, self.max_rate))
        return rows


@keras.saving.register_keras_serializable(package="tf_dp")
class RateConstraint(Constraint):
    """Σ_t coef_t · rate(ŷ = k_t | example in S_t) ≤ bound, in the paper's general form.

    ``terms``: (partitions, class, coefficient) triples; partitions are group ids, or
    (group, label) pairs when ``by_label=True``.

    Args:
      terms: (partitions, class, coefficient) triples (at least one).
      bound: the right-hand side of the inequality.
      by_label: whether partitions are (group, label) pairs rather than group ids.
      name: the constraint's name.

    Raises:
      ValueError: ``terms`` is empty.
    """

    def __init__(self, terms: Sequence[tuple], bound: float, by_label: bool = False, name: str = "rate_constraint"):
        if not terms:
            raise ValueError("`terms` must list at least one (partitions, class, coefficient) triple.")
        self.terms, self.bound, self.needs_labels, self.name = list(terms), _checks.real("bound", bound), by_label, name
        self._config = {"terms": self.terms, "bound": self.bound, "by_label": by_label, "name": name}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["terms"] = [(_as_tuple(m), k, c) for m, k, c in config["terms"]]  # JSON turned tuples into lists
        return cls(**config)

    def expand(self, num_groups, num_classes, partition):
        terms = []
        for members, k, coefficient in self.terms:
            single = isinstance(members, (int, np.integer)) or (self.needs_labels and _is_pair(members))
            members = (members,) if single else members
            cells = tuple(partition(*m) if self.needs_labels else partition(m, None) for m in members)
            terms.append(RateTerm(cells, int(k), float(coefficient)))
        return [(self.name, terms, self.bound)]


def _as_tuple(value):
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value


def _is_pair(value) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, (int, np.integer)) for v in value)


class Partitioning:
    """q = z (groups only) or q = z · K + y (group × label)."""

    def __init__(self, num_groups: int, num_classes: int, label_aware: bool):
        self.num_groups, self.num_classes, self.label_aware = num_groups, num_classes, label_aware
        self.size = num_groups * (num_classes if label_aware else 1)

    def __call__(self, group, label):
        if not 0 <= group < self.num_groups:
            raise ValueError(f"Constraint refers to group {group}, but `num_groups`={self.num_groups}.")
        return group * self.num_classes + label if self.label_aware else group

    def ids(self, groups: tf.Tensor, labels: tf.Tensor) -> tf.Tensor:
        groups = tf.cast(groups, tf.int32)
        return groups * self.num_classes + tf.cast(labels, tf.int32) if self.label_aware else groups


class ConstraintSet:
    """All constraints as matrices: rate terms t with subset S [T, Q], class one-hot [T, K],
    coefficient c [T] and owning constraint j [T].

    Args:
      constraints: the tf_dp.raco constraints (at least one).
      num_groups: the number of groups z (positive).
      num_classes: the model's number of classes.

    Raises:
      ValueError: ``constraints`` is empty or ``num_groups`` is not positive.
      TypeError: an element is not a tf_dp.raco constraint.
    """

    def __init__(self, constraints: Sequence[Constraint], num_groups: int, num_classes: int):
        constraints = list(constraints)
        if not constraints:
            raise ValueError("`constraints` must hold at least one constraint.")
        for c in constraints:
            if not isinstance(c, Constraint):
                raise TypeError(f"Each constraint must be a tf_dp.raco constraint, got {type(c).__name__}.")
        self.num_groups = _checks.positive_int("num_groups", num_groups)
        self.num_classes = num_classes
        self.partitioning = Partitioning(num_groups, num_classes, any(c.needs_labels for c in constraints))
        rows = [row for c in constraints for row in c.expand(num_groups, num_classes, self.partitioning)]
        self.names = [name for name, _, _ in rows]
        self.bounds = np.array([bound for _, _, bound in rows], np.float32)
        terms = [(j, term) for j, (_, row_terms, _) in enumerate(rows) for term in row_terms]
        q = self.partitioning.size
        self._subsets = np.zeros((len(terms), q), np.float32)
        self._classes = np.zeros((len(terms), num_classes), np.float32)
        self._coefficients = np.array([t.coefficient for _, t in terms], np.float32)
        self._owners = np.array([j for j, _ in terms], np.int32)
        for index, (_, term) in enumerate(terms):
            if not 0 <= term.label < num_classes:
                raise ValueError(f"Constraint term uses class {term.label}, but the model has {num_classes} classes.")
            self._subsets[index, list(term.partitions)] = 1.0
            self._classes[index, term.label] = 1.0

    def __len__(self) -> int:
        return len(self.names)

    def _term_rates(self, histogram: tf.Tensor):
        sizes = tf.reduce_sum(histogram, axis=1)  # N̂_q from the histogram itself
        # A noisy size can be ≤ 0 for a tiny group; clamp the denominator (post-processing).
        denominators = tf.maximum(tf.linalg.matvec(self._subsets, sizes), 1.0)
        numerators = tf.reduce_sum(tf.matmul(self._subsets, histogram) * self._classes, axis=1)
        return numerators / denominators, denominators

    def values(self, histogram: tf.Tensor) -> tf.Tensor:
        """Γ_j for every constraint j."""
        rates, _ = self._term_rates(histogram)
        return tf.math.unsorted_segment_sum(self._coefficients * rates, self._owners, len(self))

    def coefficients(self, histogram: tf.Tensor, multipliers: tf.Tensor) -> tf.Tensor:
        """W[q, k] = Σ_j λ_j ∂Γ_j/∂p_k for an example of partition q (N̂ held fixed: the
        probabilities of one example sum to 1, so its share of N̂ does not move)."""
        _, denominators = self._term_rates(histogram)
        weights = tf.gather(multipliers, self._owners) * self._coefficients / denominators
        return tf.matmul(self._subsets, self._classes * weights[:, None], transpose_a=True)
