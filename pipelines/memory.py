"""What a call will need on the GPU, before it starts (``pipe.estimate_memory``; issue #32).

A call goes through up to three phases, each holding its own set of buffers: the prompt (the text
encoder's weights), the scale loop (the transformer's weights, the KV cache, the activations of the
largest scale) and the decode (the tokenizer's weights and the decoder's full-resolution
activations). Without offload every component's weights are on the GPU in every phase; with
``enable_model_cpu_offload`` only those of the phase. The KV cache (sized exactly: it is built on
the meta device with the policies' compression) and the activations of the loop stay allocated
between calls of one shape (the workspace), so they count in every phase but the decode of a
family that frees its cache for the decoder (Infinity).

The activations of the scale loop are estimated as ``rows × tokens of the largest scale × width ×
ACTIVATION_BYTES_PER_CHANNEL``, a constant fitted to the peaks measured on an H100 (Infinity-2B and
8B at 1024², dense and ScaleKV; benchmarks/results/README.md, Session 27); the rest is counted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# bytes per token row and channel of the loop's largest scale: its block activations, the head's
# logits and the CUDA-graph pool (fitted: Infinity-2B 1024² dense 1.0 GB over weights and cache at
# 2 × 4096 rows × 2048 channels, 8B 2.2 GB at 3584 channels)
ACTIVATION_BYTES_PER_CHANNEL = 70

# What PyTorch's allocator holds beyond the allocated peak is about the loop's activations once more: the
# CUDA-graph pool and the eagerly run steps' cached blocks hold them apart. With expandable segments
# (Session 28, H100, 1024²) reserved − allocated was 0.65 (2B dense), 1.23 (2B ScaleKV), 1.18 (2B ScaleKV +
# offload), 0.99 (8B dense), 1.11 (8B streaming + ScaleKV) and 0.49 GB (HART streaming + ScaleKV), against
# activations of 1.17 (2B), 2.06 (8B) and 0.88 GB (HART). PyTorch's default allocator held up to 3.2 GB more.
# ``MemoryEstimate.reserved_bytes`` is what a card must have.


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


@dataclass(frozen=True)
class MemoryEstimate:
    """The bytes a call needs on its device, by phase (``"prompt"``, ``"scale loop"``, ``"decode"``)
    and part; ``peak_bytes`` is the largest phase's total, ``peak_phase`` its name."""

    phases: dict = field(default_factory=dict)
    device: str = "cuda"

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: sum(self.phases[p].values()))

    @property
    def peak_bytes(self) -> int:
        return int(sum(self.phases[self.peak_phase].values()))

    @property
    def working_bytes(self) -> int:
        """The most any phase needs beyond the weights (KV cache, activations, decoder): what a memory
        manager that places the weights itself (ComfyUI's) must keep free besides them."""
        return int(max(sum(v for k, v in p.items() if not k.endswith("weights")) for p in self.phases.values()))

    @property
    def reserved_bytes(self) -> int:
        """What the allocator will hold at the peak: ``peak_bytes`` and the loop's activations once more
        (see the note above; with expandable segments)."""
        return self.peak_bytes + int(self.phases.get("scale loop", {}).get("activations", 0))

    def fits(self, available_bytes: int) -> bool:
        return self.peak_bytes <= available_bytes

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {gb(v)}" for k, v in self.phases[self.peak_phase].items() if v)
        return f"peak {gb(self.peak_bytes)} in the {self.peak_phase} ({parts})"
