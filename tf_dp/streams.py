"""The one allocator of random streams (docs/algorithms.md Appendix B.3).

Every draw tf_dp makes from one secret is told apart from the secret's other draws by a
stream code: a Philox draw of the noise key is seeded by fold_in((key, step), code)
(``tf_dp.noise.gaussian.draw_seed``); a sampler's numpy generator of step t by
``default_rng([seed, code])``. Two draws share randomness only if they share a code, so every
code a module uses is allocated here, by name, and an allocation that overlaps an earlier one
raises at import. No module numbers a stream by hand.

A stream is a single code or a range of codes (the Gaussian gradient draws compute one code per
(variable, replica, replica count) within their range). ``PHILOX`` holds the noise key's
streams, ``SAMPLER`` the sampling seed's. The codes below are the ones tf_dp has always used, so
a seeded run draws what it drew before; a new kind of draw calls ``PHILOX.allocate(name)`` and
takes the next free negative code.
"""

from __future__ import annotations

from dataclasses import dataclass

_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Stream:
    """Codes ``first`` … ``last`` (inclusive) reserved for one named kind of draw.

    Args:
      name: what the draws are (unique within an allocator).
      first: the lowest code.
      last: the highest code.
    """

    name: str
    first: int
    last: int

    @property
    def code(self) -> int:
        """The code of a single-code stream."""
        if self.first != self.last:
            raise ValueError(f"stream {self.name!r} is a range [{self.first}, {self.last}]; compute its code.")
        return self.first

    def __contains__(self, code: int) -> bool:
        return self.first <= code <= self.last


class StreamAllocator:
    """Named, pairwise disjoint streams of one secret.

    Args:
      secret: what the codes are folded into (for messages only).
    """

    def __init__(self, secret: str):
        self.secret = secret
        self._streams: dict = {}

    def allocate(self, name: str, first: int | None = None, last: int | None = None) -> Stream:
        """Reserves ``name``: codes [first, last], or, without them, the next free negative code.

        Args:
          name: the stream's name, not yet allocated.
          first: the lowest code of a fixed allocation (None: the next free code below −1's).
          last: the highest code (default ``first``).

        Returns:
          The ``Stream``.

        Raises:
          ValueError: if ``name`` is taken or the codes overlap another stream's.
        """
        if name in self._streams:
            raise ValueError(f"{self.secret} stream {name!r} is already allocated.")
        if first is None:
            first = self._next_free()
        stream = Stream(name, int(first), int(first if last is None else last))
        if stream.first > stream.last:
            raise ValueError(f"{self.secret} stream {name!r}: first {first} > last {last}.")
        for other in self._streams.values():
            if stream.first <= other.last and other.first <= stream.last:
                raise ValueError(f"{self.secret} stream {name!r} [{stream.first}, {stream.last}] overlaps "
                                 f"{other.name!r} [{other.first}, {other.last}]: two draws would share randomness.")
        self._streams[name] = stream
        return stream

    def _next_free(self) -> int:
        code = -1
        while any(code in stream for stream in self._streams.values()):
            code -= 1
        return code

    def __getitem__(self, name: str) -> Stream:
        return self._streams[name]

    def streams(self) -> tuple:
        """Every allocated stream, in allocation order.

        Returns:
          A tuple of ``Stream``.
        """
        return tuple(self._streams.values())


PHILOX = StreamAllocator("noise-key")
#: Gaussian gradient noise: one code per (variable, replica, replica count), tf_dp.noise.gaussian.
GAUSSIAN_GRADIENT = PHILOX.allocate("gaussian_gradient", 0, _INT64_MAX)
#: A second release of a sum the optimizer performs for a plug-in (RaCO-DP's Laplace histogram).
SUM_RELEASE = PHILOX.allocate("sum_release", -1)
#: Adaptive clipping's noisy count of unclipped examples, one replica (tf_dp.clipping.adaptive).
ADAPTIVE_COUNT = PHILOX.allocate("adaptive_count", -2)
#: Its shares under R > 1 replicas: −(2⁴⁰ + r·2²⁰ + R) for r, R < 2²⁰.
ADAPTIVE_COUNT_SHARES = PHILOX.allocate("adaptive_count_shares", -(2**41), -(2**40 + 1))

SAMPLER = StreamAllocator("sampling-seed")
#: The batch of step t: default_rng([seed, t]) (Poisson, user-level sampling).
SAMPLER_STEPS = SAMPLER.allocate("step_batches", 0, 2**63 - 1)
#: User-level sampling's secret order of each user's examples: default_rng([seed, code]).
USER_ORDER = SAMPLER.allocate("user_order", 2**63 + 0x05E5)

SPAWN = StreamAllocator("sampling-seed spawn-key")
#: Cyclic Poisson sampling's SeedSequence spawn keys: (0,) the groups, (1, t) the batch of step t.
CYCLIC_GROUPS = SPAWN.allocate("cyclic_groups", 0)
CYCLIC_STEPS = SPAWN.allocate("cyclic_steps", 1)
