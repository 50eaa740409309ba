"""Scale schedules: the (h, w) token map of every scale and where each scale sits in the token axis."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ScaleSchedule:
    """The token maps of one generation, smallest first.

    ``hw[si]`` is the (height, width) of scale ``si`` in tokens; tokens of a scale are ordered
    row-major (y, x). ``offsets[si]`` is the index of the first token of scale ``si`` on the
    concatenated token axis (the KV axis of a dense generation); ``offsets[-1]`` is the total.
    Policies key their decisions on ``from_end(si)`` (0 = last scale), never on a map width, so the
    same setting works at every resolution and aspect ratio.
    """

    hw: tuple[tuple[int, int], ...]

    def __post_init__(self):
        if len(self.hw) == 0:
            raise ValueError("a scale schedule needs at least one scale")
        for h, w in self.hw:
            if int(h) < 1 or int(w) < 1:
                raise ValueError(f"scale sizes must be positive, got {self.hw}")

    @classmethod
    def square(cls, patch_nums: Sequence[int]) -> "ScaleSchedule":
        return cls(tuple((int(p), int(p)) for p in patch_nums))

    @classmethod
    def from_any(cls, spec) -> "ScaleSchedule":
        """A schedule from a ScaleSchedule, a list of ints (square) or a list of (h, w) pairs."""
        if isinstance(spec, ScaleSchedule):
            return spec
        items = list(spec)
        if all(isinstance(p, int) for p in items):
            return cls.square(items)
        return cls(tuple((int(h), int(w)) for h, w in items))

    @property
    def num_scales(self) -> int:
        return len(self.hw)

    def tokens(self, si: int) -> int:
        h, w = self.hw[si]
        return h * w

    @property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [0], 0
        for h, w in self.hw:
            acc += h * w
            out.append(acc)
        return tuple(out)

    @property
    def total_tokens(self) -> int:
        return self.offsets[-1]

    @property
    def latent_hw(self) -> tuple[int, int]:
        return self.hw[-1]

    def from_end(self, si: int) -> int:
        """0 for the last scale, 1 for the one before, ..."""
        return self.num_scales - 1 - si

    def index_from_end(self, k: int) -> int:
        """The scale index ``si`` that is ``k`` scales before the last one."""
        if not 0 <= k < self.num_scales:
            raise ValueError(f"scale {k} from the end does not exist: this schedule has {self.num_scales} scales")
        return self.num_scales - 1 - k

    def __len__(self) -> int:
        return self.num_scales

    def __str__(self) -> str:
        return ",".join(f"{h}" if h == w else f"{h}x{w}" for h, w in self.hw)
