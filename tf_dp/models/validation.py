"""Model validation: layers that break per-example privacy are listed before any step runs.

Per-example clipping bounds one example's influence only if example i's loss depends on
example i alone and no data-dependent term escapes clipping. BatchNormalization (batch
statistics), stateful layers (state carried across batches) and activity regularizers
(a batch loss outside the per-example loss) break that.
"""

from __future__ import annotations

import keras


def validate(model) -> list[str]:
    """One line per layer that breaks per-example privacy, with the fix; [] if none."""
    problems = []
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.BatchNormalization):
            problems.append(
                f"{layer.name} (BatchNormalization) mixes examples through batch statistics: "
                "replace it by keras.layers.GroupNormalization or LayerNormalization (tf_dp.fix does it)."
            )
        if getattr(layer, "stateful", False):
            problems.append(
                f"{layer.name} ({type(layer).__name__}) is stateful: its state carries examples across batches. "
                "Use stateful=False."
            )
        if getattr(layer, "activity_regularizer", None) is not None:
            problems.append(
                f"{layer.name} has an activity_regularizer, a data-dependent batch loss that is "
                "neither clipped nor noised: remove it (weight regularizers are fine)."
            )
    return problems


def check_model(model) -> None:
    problems = validate(model)
    if problems:
        raise ValueError("This model cannot be trained with differential privacy:\n  - " + "\n  - ".join(problems))


@keras.saving.register_keras_serializable(package="tf_dp")
class GroupNormalizationForBatchNorm(keras.layers.GroupNormalization):
    """GroupNormalization taking BatchNormalization's call arguments (mask, training), so
    that it can stand in a cloned graph where BatchNormalization was."""

    def call(self, inputs, training=None, mask=None):
        return super().call(inputs)


def _group_count(channels: int, at_most: int = 32) -> int:
    return max(d for d in range(1, min(channels, at_most) + 1) if channels % d == 0)


def fix(model):
    """A copy of a functional/Sequential model with every BatchNormalization replaced by
    GroupNormalization (groups = the largest divisor of the channels ≤ 32, as Opacus does).
    The replacements are freshly initialised; other layers keep their weights."""
    replaced = []

    def clone(layer):
        if isinstance(layer, keras.layers.BatchNormalization):
            channels = int(layer.input.shape[layer.axis if isinstance(layer.axis, int) else layer.axis[0]])
            replaced.append(layer.name)
            return GroupNormalizationForBatchNorm(groups=_group_count(channels), axis=-1, name=f"{layer.name}_group_norm")
        return layer.__class__.from_config(layer.get_config())

    copy = keras.models.clone_model(model, clone_function=clone)
    for original, new in zip(model.layers, copy.layers):
        if not isinstance(original, keras.layers.BatchNormalization) and original.weights:
            new.set_weights(original.get_weights())
    for name in replaced:
        print(f"tf_dp.fix: replaced BatchNormalization {name} by GroupNormalization.")
    remaining = [p for p in validate(copy)]
    if remaining:
        raise ValueError("tf_dp.fix cannot repair:\n  - " + "\n  - ".join(remaining))
    return copy



