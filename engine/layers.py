"""The one layer loop every family runs through: stage input → gather the plan's tokens → the layers
with their policy hooks → scatter → post_hidden → head.

A family supplies only what differs (its adapter): the stage input, a :class:`LayerCall` per layer
(where a block runs: its cache, positions and per-layer constants), one block unchained or
chained (the dense path, whose fused steps span the sub-layer borders: each residual add runs with
the next sub-layer's norm), and the head. The loop owns the rest: the kept-row gather and scatter,
the KV positions, which layers a sub-layer wrapper acts on, the observe taps.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..sparse_ops.ops import gather_rows, scatter_rows
from .state import RunState


class LayerCall:
    """Where a block runs during generation: the KV cache, scale ``si``, ``layer``, the run, the
    kernels (``ops``), and the absolute positions (``pos``: (l,) or (R, l)) and key validity
    (``valid_Rl``, None = all valid) of the tokens the layer runs on. ``record``: layers are out of
    step (per-layer pruning), so each records the positions it writes. A family subclasses it for
    its per-layer constants."""

    __slots__ = ("kv", "si", "layer", "run", "ops", "pos", "valid_Rl", "record")

    def __init__(self, kv, si: int, layer: int, run: Optional[RunState], ops, pos: torch.Tensor,
                 valid_Rl: Optional[torch.Tensor], record: bool):
        self.kv, self.si, self.layer, self.run, self.ops = kv, si, layer, run, ops
        self.pos, self.valid_Rl, self.record = pos, valid_Rl, record

    def positions(self, idx_Rn: Optional[torch.Tensor]):
        """(absolute positions (l,) or (R, n), validity or None) of the tokens being written: the
        layer's, or the subset ``idx_Rn`` of them a sub-layer wrapper runs."""
        if idx_Rn is None:
            return self.pos, self.valid_Rl
        R = idx_Rn.shape[0]
        pos_Rn = self.pos.expand(R, -1).gather(1, idx_Rn)
        valid = self.valid_Rl.gather(1, idx_Rn) if self.valid_Rl is not None else None
        return pos_Rn, valid

    def reserve(self, l: int, idx_Rn: Optional[torch.Tensor], pos=None, valid=None):
        """This layer's cache slots for ``l`` new tokens (K and V destinations, (R, H, l, d)); their
        positions (``pos``/``valid`` if the caller has them) are recorded when a subset runs or the
        layers are out of step."""
        if pos is None:
            pos, valid = self.positions(idx_Rn)
        return self.kv.reserve(self.layer, l, pos if self.record or idx_Rn is not None else None, valid)


def run_layers(adapter, si: int, idx_Bn: Optional[torch.Tensor], valid_Bn: Optional[torch.Tensor], run: RunState,
               collect: bool = False, into_head: bool = False):
    """Stage input → gather ``idx_Bn`` (None: every token) → blocks → scatter: (x, taps, head input).
    The tapped layers' (``run.hooks``) input and output go to the policies' observe, or with
    ``collect`` are returned instead. With ``into_head`` (no subset, a chained last block) the last
    block also returns the head's modulated input (else None)."""
    ws, R, B = run.workspace, run.rows, run.batch_size
    stack, hooks, collected = run.policies, run.hooks, []
    x0_RLC = adapter.stage_input(si, run)
    start, L = run.schedule.offsets[si], x0_RLC.shape[1]
    kv = ws.kv
    idx_Rn = valid_Rn = None
    if idx_Bn is not None:
        idx_Rn = idx_Bn.repeat(R // B, 1)                                              # one token set per image
        x_RlC = gather_rows(x0_RLC, idx_Rn)                                          # (R, L, C) → (R, n, C)
        pos = idx_Rn + start
        if valid_Bn is not None:
            valid_Rn = valid_Bn.repeat(R // B, 1)
    else:
        x_RlC = x0_RLC
        pos = ws.positions_L[start:start + L]
    record = len(set(kv.lengths)) > 1                  # layers out of step (per-layer pruning): record per layer
    if not record:
        kv.record_positions(kv.lengths[0], pos)        # layers in step: one write for all ((L,) or (R, n))
    N = adapter.num_layers
    # layers no sub-layer wrapper changes run the dense path, fused across block borders
    chained = [adapter.chains_layers() and not hooks.wraps(i) for i in range(N)] + [into_head]
    shared = adapter.scale_constants(si, run, pos)
    y_RlC = None                                       # a chained layer's modulated attention input
    stream = adapter.layer_stream                      # weights streamed layer by layer, or None
    for i in range(N):
        if stream is not None:
            stream.enter(i)
        x_in = x_RlC
        call = adapter.layer_call(si, i, run, pos, valid_Rn, record, shared)
        if chained[i]:
            if y_RlC is None:
                y_RlC = adapter.chain_input(i, x_RlC, run)
            x_RlC, y_RlC = adapter.chained_layer(i, x_RlC, y_RlC, chained[i + 1], call)
        else:
            x_RlC, y_RlC = adapter.layer(i, x_RlC, call), None
        if hooks.tapped(i):
            if collect:
                collected.append((i, x_in, x_RlC))
            else:
                stack.observe(si, ("layer", i), x_in, x_RlC, run)
        if stream is not None:
            stream.leave(i)
    if idx_Rn is not None:
        x_RlC = scatter_rows(x0_RLC, idx_Rn, x_RlC)                                  # (R, n, C) → (R, L, C)
    return x_RlC, collected, (y_RlC if into_head else None)


@torch.no_grad()
def compute_scale(adapter, si: int, plan, run: RunState, graphs=None) -> Optional[torch.Tensor]:
    """The logits of every row of scale ``si``'s full map, (R, h·w, V) (float32, or a dtype the
    family's ``guide`` takes), reading only workspace buffers, so that the scale can be captured.

    With ``graphs`` (the engine's graph runner) the layer stack replays from a graph (None when it
    cannot be used now); post_hidden and the head then run eagerly. Without a subset, a hidden-state
    rewrite or graphs, a family that chains its layers into the head (``chains_into_head``) runs the
    last block's gated residual and the head's LayerNorm + AdaLN as one step."""
    if graphs is not None:
        x_RLC = graphs.layer_stack(si, plan, run,
                                   lambda idx_Bn, collect: run_layers(adapter, si, idx_Bn, None, run, collect)[:2])
        if x_RLC is None:
            return None
    else:
        idx = plan.token_index.to(adapter.device, torch.long) if plan.token_index is not None else None
        valid = plan.token_valid.to(adapter.device) if plan.token_valid is not None else None
        into_head = idx is None and adapter.chains_into_head() and not run.hooks["post_hidden"]
        x_RLC, _, y_RLC = run_layers(adapter, si, idx, valid, run, into_head=into_head)
        if y_RLC is not None:
            return adapter.head(y_RLC, run, modulated=True)
    return adapter.head(run.policies.post_hidden(si, x_RLC, run), run)
