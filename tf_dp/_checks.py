"""Argument validation shared by the public API.

Every check raises ``ValueError``/``TypeError`` naming the argument and the fix, so a
misconfiguration is loud instead of silently running a non-private (or broken) job.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def real(name: str, value: Any) -> float:
    if not _is_real(value):
        raise TypeError(f"`{name}` must be a real number, got {value!r} ({type(value).__name__}).")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"`{name}` must not be NaN.")
    return value


def positive(name: str, value: Any, fix: str = "") -> float:
    value = real(name, value)
    if not value > 0 or math.isinf(value):
        raise ValueError(f"`{name}` must be a finite number > 0, got {value}.{(' ' + fix) if fix else ''}")
    return value


def non_negative(name: str, value: Any, fix: str = "") -> float:
    value = real(name, value)
    if value < 0 or math.isinf(value):
        raise ValueError(f"`{name}` must be a finite number >= 0, got {value}.{(' ' + fix) if fix else ''}")
    return value


def in_open_unit_interval(name: str, value: Any) -> float:
    value = real(name, value)
    if not 0 < value < 1:
        raise ValueError(f"`{name}` must lie in (0, 1), got {value}.")
    return value


def positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be a positive integer, got {value!r}.")
    if value <= 0:
        raise ValueError(f"`{name}` must be a positive integer, got {value}.")
    return int(value)


def boolean(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be True or False, got {value!r}.")
    return bool(value)


def one_of(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {choices}, got {value!r}.")
    return value


def delta(value: Any) -> float:
    value = real("delta", value)
    if not 0 < value < 1:
        raise ValueError(
            f"`delta` must lie in (0, 1), got {value}. Use delta <= 1/num_examples (e.g. 1e-5)."
        )
    return value


def batch_size_for(num_examples: int, batch_size: Any) -> int:
    batch_size = positive_int("batch_size", batch_size)
    if batch_size > num_examples:
        raise ValueError(
            f"`batch_size`={batch_size} exceeds the number of examples ({num_examples}): the "
            "sampling rate batch_size / num_examples must be <= 1. Use a smaller batch_size."
        )
    return batch_size


def registered_part(argument: str, value, registry: dict, base: type, default: type, kind: str):
    """A part of the DP mechanism given as ``argument=`` (docs/design.md): None → ``default()``,
    an instance of ``base``, a name in ``registry`` (its class, built without arguments), or a
    Keras-serialized instance (a config dict, as saved in an optimizer's config).

    Args:
      argument: the argument's name, for the error message.
      value: what the user passed.
      registry: {name: class} of the registered parts.
      base: the parts' base class.
      default: the class None stands for.
      kind: how the error names a valid part, e.g. "a tf_dp.noise.Privatizer (e.g. BandMF(4))".
    """
    import keras

    if value is None:
        return default()
    if isinstance(value, base):
        return value
    if isinstance(value, str):
        if value not in registry:
            raise ValueError(f"`{argument}` must be {kind} or one of {sorted(registry)}, got {value!r}.")
        return registry[value]()
    if isinstance(value, dict):
        resolved = keras.saving.deserialize_keras_object(value)
        if isinstance(resolved, base):
            return resolved
    raise TypeError(f"`{argument}` must be {kind} or one of {sorted(registry)}, got {value!r}.")
