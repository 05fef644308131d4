"""Refuses layers that break per-example privacy before any training step runs."""

from __future__ import annotations

import keras


def privacy_problems(model) -> list[str]:
    """One line per layer that mixes examples or adds a data-dependent batch term."""
    problems = []
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.BatchNormalization):
            problems.append(
                f"{layer.name} (BatchNormalization) mixes examples through batch statistics: "
                "replace it by keras.layers.GroupNormalization or LayerNormalization."
            )
        if getattr(layer, "activity_regularizer", None) is not None:
            problems.append(
                f"{layer.name} has an activity_regularizer, a data-dependent batch loss that is "
                "neither clipped nor noised: remove it (weight regularizers are fine)."
            )
    return problems


def check_model(model) -> None:
    problems = privacy_problems(model)
    if problems:
        raise ValueError("This model cannot be trained with differential privacy:\n  - " + "\n  - ".join(problems))
