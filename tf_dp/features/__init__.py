"""Fixed, data-independent feature maps computed per example (no privacy cost)."""

from tf_dp.features.scattering import ScatteringTransform2D, scattering_features

__all__ = ["ScatteringTransform2D", "scattering_features"]
