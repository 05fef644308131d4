"""RaCO-DP's sampling scheme: Poisson batches that release a gradient and a histogram.

The batch is Poisson-sampled exactly as DP-SGD's (docs/algorithms.md §1 step 1); what differs is
the ledger's record: scheme "raco_poisson" with the Laplace scale 1/b of the histogram released
from the same batch as its parameter, which RaCO-DP's joint accountant composes
(docs/algorithms.md §5.5; ``tf_dp.raco.accounting``). ``RateConstrainedModel.fit`` passes this
scheme to ``DPModel.fit`` (``sampling=``): the core knows nothing of RaCO-DP.
"""

from __future__ import annotations

import dataclasses

from tf_dp.raco.accounting import SCHEME
from tf_dp.sampling.schemes import PoissonSampling


@dataclasses.dataclass(frozen=True)
class JointPoissonSampling(PoissonSampling):
    """Poisson sampling (q = L/N) recorded as one Gaussian + Laplace step per batch.

    Attributes:
      histogram_noise: the Laplace scale 1/b of the noisy histogram (public).
    """

    histogram_noise: float = 0.0

    @property
    def ledger_scheme(self) -> str:
        return SCHEME

    @property
    def ledger_parameter(self) -> float:
        return float(self.histogram_noise)
