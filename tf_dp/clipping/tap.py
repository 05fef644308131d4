"""Taps: swap each trainable layer's ``call`` for its rule's recording call, for one trace.

Inside ``LayerTap`` every layer that owns trainable variables records what its rule needs
(inputs, pre-activation outputs) during the model's ordinary forward pass; outside, the
layers are untouched. The swap is per instance and undone on exit, so the same model keeps
serving plain Keras calls.
"""

from __future__ import annotations

import contextlib
import functools

from tf_dp.clipping.layer_per_example import LayerPerExampleRule
from tf_dp.clipping.registry import GhostRule, ghost_rule_for


class LayerTap:
    """Context manager recording, per tapped layer, a list of ``Recording``s."""

    def __init__(self, layers, use_ghost_rules: bool = True):
        fallback = LayerPerExampleRule(self)
        self.units: list[tuple[object, GhostRule]] = [
            (layer, (ghost_rule_for(layer) if use_ghost_rules else None) or fallback) for layer in layers
        ]
        self.recordings = {id(layer): [] for layer, _ in self.units}
        self._paused = False

    def __enter__(self):
        for layer, rule in self.units:
            original_call = type(layer).call.__get__(layer)
            object.__setattr__(layer, "call", self._recording_call(layer, rule, original_call))
        return self

    def __exit__(self, *exc):
        for layer, _ in self.units:
            layer.__dict__.pop("call", None)
        return False

    def _recording_call(self, layer, rule, original_call):
        recordings = self.recordings[id(layer)]

        @functools.wraps(original_call)
        def call(*args, **kwargs):
            if self._paused:
                return original_call(*args, **kwargs)
            return rule.tapped_call(layer, original_call, recordings, *args, **kwargs)

        return call

    @contextlib.contextmanager
    def paused(self):
        """Plain calls (no recording) while a rule replays a layer."""
        previous, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = previous

    def watched_tensors(self) -> list:
        return [t for layer, _ in self.units for r in self.recordings[id(layer)] for t in r.watched]

    def contributions(self, output_grads: list):
        """Splits the flat gradient list of ``watched_tensors`` back per layer and builds
        each layer's ``Contribution`` (skipping layers not called in this pass)."""
        grads = iter(output_grads)
        result = []
        for layer, rule in self.units:
            recordings = self.recordings[id(layer)]
            per_recording = [[next(grads) for _ in r.watched] for r in recordings]
            if recordings:
                result.append((layer, rule, rule.contribution(layer, recordings, per_recording)))
        return result
