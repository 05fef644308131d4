"""Model validation: layers that break per-example privacy are listed before any step runs.

Per-example clipping bounds one example's influence only if example i's loss depends on
example i alone and no data-dependent term escapes clipping. Layers whose output row i
depends on other rows break that: BatchNormalization (batch statistics), MixUp and CutMix
(each row blends another example of the batch), Equalization (one histogram over the
whole batch; also inside RandAugment and AugMix), MelSpectrogram with power_to_db (the dB
floor is the batch's maximum minus top_db). So do stateful layers (state carried across
batches) and activity regularizers (a batch loss outside the per-example loss).
Augmentations that draw random parameters per batch or per image and transform each image
alone (RandomFlip, RandomRotation, RandomContrast, ...) are fine. Layers not listed here
(custom ones) are tested by ``tf_dp.models.row_independence.check_rows_independent``.
"""

from __future__ import annotations

import keras

_PER_EXAMPLE_AUGMENTATION = "augment each example alone (e.g. RandomFlip, RandomRotation, RandomContrast)"

# (Keras layer class, when it mixes rows, why, and the fix).
MIXING_LAYERS = (
    (keras.layers.BatchNormalization, lambda layer: True,
     "mixes examples through batch statistics: replace it by keras.layers.GroupNormalization or "
     "LayerNormalization (tf_dp.fix does it)."),
    (keras.layers.MixUp, lambda layer: True,
     f"blends each example with another example of the batch: remove it; {_PER_EXAMPLE_AUGMENTATION}."),
    (keras.layers.CutMix, lambda layer: True,
     f"pastes a patch of another example of the batch into each example: remove it; {_PER_EXAMPLE_AUGMENTATION}."),
    (keras.layers.Equalization, lambda layer: True,
     "equalizes with one histogram over the whole batch, so each example changes the others: remove it "
     f"(RandAugment and AugMix contain it); {_PER_EXAMPLE_AUGMENTATION}."),
    (keras.layers.MelSpectrogram, lambda layer: getattr(layer, "power_to_db", False),
     "with power_to_db=True floors every example at the batch's maximum dB minus top_db: use "
     "power_to_db=False and apply the dB scale per example."),
)


def validate(model) -> list[str]:
    """One line per layer that breaks per-example privacy, with the fix; [] if none.
    Every nested layer and model is inspected (its enclosing layers are named)."""
    problems = []
    for layer, path in _nested_layers(model):
        where = f"{layer.name}{f' in {path}' if path else ''}"
        for kind, mixes, fix_hint in MIXING_LAYERS:
            if isinstance(layer, kind) and mixes(layer):
                problems.append(f"{where} ({type(layer).__name__}) {fix_hint}")
        if getattr(layer, "stateful", False):
            problems.append(
                f"{where} ({type(layer).__name__}) is stateful: its state carries examples across batches. "
                "Use stateful=False."
            )
        if getattr(layer, "activity_regularizer", None) is not None:
            problems.append(
                f"{where} has an activity_regularizer, a data-dependent batch loss that is "
                "neither clipped nor noised: remove it (weight regularizers are fine)."
            )
    return problems


def _nested_layers(model, path: str = "", seen=None):
    """(layer, "outer/inner" names of the layers enclosing it) once for every layer below
    ``model``, nested models and layers included."""
    seen = set() if seen is None else seen
    for layer in model._flatten_layers(include_self=False, recursive=False):
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        yield layer, path
        yield from _nested_layers(layer, f"{path}/{layer.name}" if path else layer.name, seen)


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



