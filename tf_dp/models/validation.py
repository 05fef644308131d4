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
from keras.src.models.functional import Functional

from tf_dp.clipping.normalization import GroupNormalizationRule
from tf_dp.clipping.registry import register_ghost_rule

_PER_EXAMPLE_AUGMENTATION = "augment each example alone (e.g. RandomFlip, RandomRotation, RandomContrast)"

# (Keras layer class, when it mixes rows, why, and the fix).
MIXING_LAYERS = (
    (keras.layers.BatchNormalization, lambda layer: True,
     "mixes examples through batch statistics: replace it by keras.layers.GroupNormalization or "
     "LayerNormalization"),
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
    Every nested layer and model is inspected (its enclosing layers are named).

    Args:
      model: a Keras model.

    Returns:
      The problems, one line each (empty if the model is fine).
    """
    problems = []
    unreachable = {id(bn): owner_path for bn, _, _, owner_path in _unreachable_batch_norms(model)} \
        if isinstance(model, (Functional, keras.Sequential)) else None
    for layer, path in _nested_layers(model):
        where = f"{layer.name}{f' in {path}' if path else ''}"
        for kind, mixes, fix_hint in MIXING_LAYERS:
            if isinstance(layer, kind) and mixes(layer):
                if kind is keras.layers.BatchNormalization:
                    fix_hint += _batch_norm_fix_hint(layer, unreachable)
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


def _batch_norm_fix_hint(layer, unreachable) -> str:
    if unreachable is None:
        return " in the model's code (tf_dp.fix rewrites functional and Sequential models only)."
    if id(layer) in unreachable:
        return (f" inside the custom layer {unreachable[id(layer)]}, whose code tf_dp.fix cannot rewrite: build "
                "that layer with GroupNormalization/LayerNormalization.")
    return " (tf_dp.fix does it)."


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


def refuse_lookups_rejecting_padding(model) -> None:
    """Raises ValueError naming every StringLookup/IntegerLookup of ``model`` (inside a
    FeatureSpace too) that has ``num_oov_indices=0`` and no token for the padding value
    (an empty string, or 0). Poisson batches are padded to a fixed width with such rows
    (masked out: they never count), and such a lookup rejects them with a Keras error at
    the first step; this says so before any step, with the fix.

    Args:
      model: the Keras model about to be trained on padded Poisson batches.
    """
    strict = [f"{where} ({type(layer).__name__}, num_oov_indices=0, no {pad!r} in its vocabulary)"
              for layer, where, pad in _lookups_rejecting_padding(model)]
    if strict:
        raise ValueError(
            "tf_dp pads each Poisson batch to a fixed width with masked-out rows (empty strings, zeros; they never "
            "count in the gradient, the loss or the metrics), and these lookups reject such rows:\n  - "
            + "\n  - ".join(strict) + "\nFix: num_oov_indices=1 (e.g. FeatureSpace.string_categorical("
            "num_oov_indices=1)): only padding and values outside the vocabulary then map to the OOV index; or "
            "give the lookup mask_token='' (0 for IntegerLookup) so that padding has a token of its own.")


def _lookups_rejecting_padding(model):
    """(lookup, where it is, the padding value it rejects) for every strict lookup."""
    features = {}
    for layer, _ in _nested_layers(model):
        if isinstance(layer, keras.utils.FeatureSpace):
            features.update({id(p): f"feature {name!r} of FeatureSpace {layer.name}"
                             for name, p in getattr(layer, "preprocessors", {}).items()})
    for layer, path in _nested_layers(model):
        if not isinstance(layer, (keras.layers.StringLookup, keras.layers.IntegerLookup)):
            continue
        if getattr(layer, "num_oov_indices", 1) != 0 or getattr(layer, "invert", False):
            continue
        pad = "" if isinstance(layer, keras.layers.StringLookup) else 0
        if pad not in {token.decode() if isinstance(token, bytes) else token for token in layer.get_vocabulary()}:
            yield layer, features.get(id(layer), f"{layer.name}{f' in {path}' if path else ''}"), pad


@keras.saving.register_keras_serializable(package="tf_dp")
class GroupNormalizationForBatchNorm(keras.layers.GroupNormalization):
    """GroupNormalization taking BatchNormalization's call arguments (mask, training), so
    that it can stand in a cloned graph where BatchNormalization was."""

    def call(self, inputs, training=None, mask=None):
        return super().call(inputs)


class _GroupNormalizationForBatchNormRule(GroupNormalizationRule):
    """GroupNormalization's ghost rule for the stand-in: ``training`` and ``mask`` do not
    change what it computes (its ``call`` ignores them)."""

    def tapped_call(self, layer, original_call, recordings, inputs, training=None, mask=None):
        return super().tapped_call(layer, original_call, recordings, inputs)


register_ghost_rule(GroupNormalizationForBatchNorm, _GroupNormalizationForBatchNormRule())


def _group_count(channels: int, at_most: int = 32) -> int:
    return max(d for d in range(1, min(channels, at_most) + 1) if channels % d == 0)


def fix(model):
    """A copy of a functional/Sequential model with every BatchNormalization replaced by
    GroupNormalization (groups = the largest divisor of the channels ≤ 32, as Opacus does),
    at any depth of nested functional/Sequential models (e.g. a keras-hub ResNet or
    EfficientNet backbone inside inputs → backbone → head; nested models come back as
    plain functional models with the same layers). The replacements are freshly
    initialised; every other layer is a copy with the original's weights.

    BatchNormalization inside a custom layer class (whose ``call`` is Python code, e.g.
    keras-hub MobileNet's blocks) cannot be swapped by rewriting the graph: ``fix`` then
    raises a ValueError naming each such layer's path and what to do instead.

    Args:
      model: a functional or Sequential Keras model.

    Returns:
      The fixed copy of the model.

    Raises:
      TypeError: ``model`` is not functional or Sequential.
      ValueError: a BatchNormalization sits inside a custom layer.
    """
    if not isinstance(model, (Functional, keras.Sequential)):
        raise TypeError(f"tf_dp.fix needs a functional or Sequential model; {getattr(model, 'name', model)!r} is a "
                        f"{type(model).__name__}. Replace its BatchNormalization layers in its own code.")
    unreachable = list(_unreachable_batch_norms(model))
    if unreachable:
        raise ValueError(
            "tf_dp.fix cannot replace BatchNormalization inside custom layers: their call() is Python code, not a "
            "graph fix can rewrite:\n  - " + "\n  - ".join(
                f"{path} ({type(bn).__name__}) inside {owner_path} ({type(owner).__name__})"
                for bn, path, owner, owner_path in unreachable)
            + "\nFix: build those layers with keras.layers.GroupNormalization or LayerNormalization instead (a "
              "subclass of the custom layer whose __init__ creates them, or a model variant without batch "
              "normalization); fix rewrites BatchNormalization only where it is a node of a functional or "
              "Sequential model."
        )
    replaced, copies = [], []

    def clone(layer):
        if isinstance(layer, keras.layers.BatchNormalization):
            axis = layer.axis if isinstance(layer.axis, int) else layer.axis[0]
            rank = getattr(layer.input_spec, "ndim", None)
            axis = -1 if rank is not None and axis == rank - 1 else axis  # channels last: GroupNormalization's rule
            channels = int(layer.moving_mean.shape[0]) if layer.built else int(layer.input.shape[axis])
            replaced.append(layer.name)
            return GroupNormalizationForBatchNorm(groups=_group_count(channels), axis=axis,
                                                  name=f"{layer.name}_group_norm")
        new = _copy_layer(layer)
        copies.append((layer, new))
        return new

    copy = keras.models.clone_model(model, clone_function=clone, recursive=True)
    for original, new in copies:
        if original.weights:
            new.set_weights(original.get_weights())
    for name in replaced:
        print(f"tf_dp.fix: replaced BatchNormalization {name} by GroupNormalization.")
    remaining = validate(copy)
    if remaining:
        raise ValueError("tf_dp.fix replaces BatchNormalization only; it cannot repair:\n  - "
                         + "\n  - ".join(remaining))
    return copy


def _copy_layer(layer):
    """A fresh copy of ``layer`` from its config; a ``Lambda`` keeps its function objects
    (a plain or local function, or a Python lambda, which its config names but Keras cannot
    look up again without registration or unsafe deserialization) as plain Keras runs it."""
    if type(layer) is keras.layers.Lambda:
        config = {key: value for key, value in layer.get_config().items()
                  if key not in ("function", "output_shape", "mask", "arguments")}
        return keras.layers.Lambda(layer.function, output_shape=layer._output_shape, mask=layer.mask,
                                   arguments=dict(layer.arguments), **config)
    return layer.__class__.from_config(layer.get_config())


def _unreachable_batch_norms(model, path: str = ""):
    """(BatchNormalization, its path, the custom layer holding it, that layer's path) for
    every BatchNormalization below a layer that is not a functional/Sequential model."""
    for layer in model._flatten_layers(include_self=False, recursive=False):
        where = f"{path}/{layer.name}" if path else layer.name
        if isinstance(layer, (Functional, keras.Sequential)):
            yield from _unreachable_batch_norms(layer, where)
        elif not isinstance(layer, keras.layers.BatchNormalization):
            for inner, inner_path in _nested_layers(layer, where):
                if isinstance(inner, keras.layers.BatchNormalization):
                    yield inner, f"{inner_path}/{inner.name}", layer, where
