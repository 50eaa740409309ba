"""ScaleKV: scale-aware KV-cache compression (arXiv 2505.19602; research/accel.md §6).

Memory, not speed. After a scale's self-attention, each *refiner* layer keeps only a budget of
its cached keys and values, chosen per image row and head; *drafter* layers, whose attention
spreads over the whole history, keep everything. The selection follows the released code: an
observation window of queries at the centres of a 4 × 4 grid over the current scale, their
attention logits against every cached key summed over the window, max-pooled along the keys
(kernel 5), the top ``budget − window`` keys kept beside the window's own keys, in cache order.

The cache is allocated for what the layers keep (``kv_slots`` → ``engine.kv_cache``), not for
the whole schedule: that is where the memory goes. Deviations from the released code, on
purpose: the window's queries are the ones the layer attends with (the release recomputes them
from the block input without the bias, the q/k normalisation and RoPE), and budgets are fractions
of the tokens cached so far, counted from the last scale, so that they apply at every resolution
(the release gives token counts for Infinity's 1024² schedule; the presets are those counts
divided by that schedule's cumulative tokens, which gives them back exactly at 1024²).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from typing import Optional, Union

import torch
import torch.nn.functional as F

from ..engine.contract import Policy, ScalePlan
from ..sparse_ops.attention import dense_attention

# the release's refiner budgets at its five compressed boundaries (after the scales of 20², 24², 32²,
# 40² and 48² tokens at 1024²), as fractions of the 921 / 1497 / 2521 / 4121 / 6425 tokens cached there
RELEASED_2B = (0.6862, 0.3968, 0.2087, 0.1019, 0.0724)          # 632 / 594 / 526 / 420 / 465 tokens
RELEASED_8B = (0.6830, 0.3901, 0.1995, 0.0908, 0.0311)          # 629 / 584 / 503 / 374 / 200 tokens


@dataclass(frozen=True)
class ScaleKVConfig:
    """ScaleKV settings. Presets per model: :data:`SCALEKV_PRESETS`; ``ScaleKVConfig.dense()``
    keeps every key (the neutral setting: the dense output, bit for bit).

    budget: the fraction of the tokens cached so far that a refiner layer keeps after a scale, in
        (0, 1]. One number applies after every scale but the last (where the cache holds more than
        ``min_tokens``); a tuple gives one per boundary for the last ones, its last entry after the
        second-to-last scale (earlier boundaries keep everything). Lower → less memory, less of
        the history each query sees. Released (Infinity-2B, "10 %"): 0.686, 0.397, 0.209, 0.102,
        0.072 on the last five boundaries; 1 keeps everything.
    drafters: the layers that keep their whole cache (0-based). Released: 0 and 23 on Infinity-2B,
        0, 1 and 2 on Infinity-8B (both found by the paper's per-layer attention analysis); the
        default keeps the first layer, a drafter in both.
    window: queries in the observation window, a square number (the grid's side, 4 for 16) whose
        logits rank the keys; their own keys are always kept. Released: 16.
    pool_kernel: width of the max-pooling over neighbouring keys' scores, odd, ≥ 1 (1: none).
        Released: 5.
    min_tokens: no compression while a layer holds at most this many tokens. Released: 650.
    """

    budget: Union[float, tuple[float, ...]] = RELEASED_2B
    drafters: tuple[int, ...] = (0,)
    window: int = 16
    pool_kernel: int = 5
    min_tokens: int = 650

    def __post_init__(self):
        budgets = self.budget if isinstance(self.budget, tuple) else (self.budget,)
        if isinstance(self.budget, list):
            object.__setattr__(self, "budget", tuple(self.budget))
            budgets = self.budget
        if not budgets or any(isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b <= 1
                              for b in budgets):
            raise ValueError(f"budget must be a fraction in (0, 1] or a non-empty tuple of them (1 keeps every key; "
                             f"released Infinity-2B: {RELEASED_2B}), got {self.budget!r}")
        if isinstance(self.drafters, list):
            object.__setattr__(self, "drafters", tuple(self.drafters))
        if not isinstance(self.drafters, tuple) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                                                       for i in self.drafters):
            raise ValueError(f"drafters must be a tuple of layer indices >= 0 (e.g. (0, 23)), got {self.drafters!r}")
        side = math.isqrt(self.window) if isinstance(self.window, int) and self.window > 0 else 0
        if isinstance(self.window, bool) or side * side != self.window:
            raise ValueError(f"window must be a square number of queries >= 1 (a grid of side × side; released "
                             f"16), got {self.window!r}")
        if isinstance(self.pool_kernel, bool) or not isinstance(self.pool_kernel, int) or self.pool_kernel < 1 \
                or self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel must be an odd int >= 1 (released 5; 1 = no pooling), got "
                             f"{self.pool_kernel!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0 (released 650), got {self.min_tokens!r}")

    @classmethod
    def dense(cls) -> "ScaleKVConfig":
        return cls(budget=1.0)

    @property
    def neutral(self) -> bool:
        budgets = self.budget if isinstance(self.budget, tuple) else (self.budget,)
        return all(b >= 1 for b in budgets)


SCALEKV_PRESETS: dict[str, ScaleKVConfig] = {
    # the release's 10 % budgets and drafter layers
    "infinity-2b": ScaleKVConfig(budget=RELEASED_2B, drafters=(0, 23)),
    "infinity-8b": ScaleKVConfig(budget=RELEASED_8B, drafters=(0, 1, 2)),
    # no released setting: Infinity-2B's budgets with the first layer as drafter, unmeasured
    "var": ScaleKVConfig(),
    "flexvar": ScaleKVConfig(),
    "hart": ScaleKVConfig(),
}


def scalekv_preset(family: str, num_layers: int, calibration: Optional[dict] = None) -> ScaleKVConfig:
    """The preset of a pipeline's family (``PRESET_FAMILY``): Infinity's 32-layer model is the 2B, its
    40-layer one the 8B, and others of the family take the release's 2B budgets with the first
    layer as drafter; a checkpoint's ``calibration`` (:func:`check_scalekv_calibration`) sets the
    drafters."""
    if family.startswith("infinity"):
        cfg = SCALEKV_PRESETS.get({32: "infinity-2b", 40: "infinity-8b"}.get(num_layers, ""),
                                  ScaleKVConfig(budget=RELEASED_2B))
    else:
        cfg = SCALEKV_PRESETS.get(family, ScaleKVConfig())
    if calibration is not None:
        cfg = replace(cfg, drafters=tuple(calibration["drafters"]))
    return cfg


def check_scalekv_calibration(calibration, where: str = "scalekv_calibration") -> Optional[dict]:
    """A checkpoint's ScaleKV calibration (``sparsevar calibrate --scalekv``), checked: None, or
    ``{"drafters": [layer, …]}`` plus, optionally, ``"measured"`` (a dict; informational). Anything
    else is a ValueError naming ``where``, the value and the fix. Returns a plain-dict copy."""
    if calibration is None:
        return None
    fix = "run `sparsevar calibrate --scalekv --model FOLDER` again, or remove the key"
    if not isinstance(calibration, dict) or set(calibration) - {"measured"} != {"drafters"}:
        raise ValueError(f"{where} must be a dict {{\"drafters\": [layer, ...]}} (and optionally \"measured\"), got "
                         f"{str(calibration)[:80]}; {fix}")
    if "measured" in calibration and not isinstance(calibration["measured"], dict):
        raise ValueError(f"{where}[\"measured\"] must be a dict of what was measured; {fix}")
    try:
        ScaleKVConfig(drafters=tuple(calibration["drafters"]) if isinstance(calibration["drafters"], list)
                      else calibration["drafters"])
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}; {fix}") from None
    return {"drafters": [int(i) for i in calibration["drafters"]],
            **({"measured": copy.deepcopy(calibration["measured"])} if "measured" in calibration else {})}


def window_positions(h: int, w: int, window: int) -> list[int]:
    """Raster positions, inside an h × w scale, of the observation window: the centres of a grid of
    side √window (fewer rows or columns on a scale smaller than the grid), as the release places them."""
    side = math.isqrt(window)
    gh, gw = min(side, h), min(side, w)
    ph, pw = h // gh, w // gw
    rows = [i * ph + (ph - 1) // 2 for i in range(gh)]
    cols = [j * pw + (pw - 1) // 2 for j in range(gw)]
    return [r * w + c for r in rows for c in cols]


class ScaleKVPolicy(Policy):
    name = "scalekv"
    incompatible = ("sparvar", "sparsevar", "fastvar")
    incompatible_why = ("ScaleKV compacts each layer's cache per head after a scale: SparVAR's key indices point "
                        "into the uncompressed cache, and SparseVAR / FastVAR run token subsets, whose queries "
                        "may miss the observation window and whose padded cache slots it does not handle")

    def __init__(self, config: ScaleKVConfig = ScaleKVConfig()):
        self.config = config

    def validate(self, info) -> None:
        bad = [i for i in self.config.drafters if i >= info.num_layers]
        if bad:
            raise ValueError(f"drafters={self.config.drafters}: layer {bad[0]} does not exist; this model has "
                             f"{info.num_layers} layers (0..{info.num_layers - 1})")
        budgets = self.config.budget
        if isinstance(budgets, tuple) and len(budgets) > info.schedule.num_scales - 1:
            raise ValueError(f"budget has {len(budgets)} entries, one per boundary between scales; this schedule "
                             f"has {info.schedule.num_scales} scales, so at most {info.schedule.num_scales - 1}")

    # ---- what the refiners keep (host numbers, from the settings and the schedule alone) ----------
    def _keep(self, schedule, scales_run: int) -> list[Optional[int]]:
        """Per scale, the slots a refiner layer keeps after it (None: no compression there)."""
        c, S = self.config, schedule.num_scales
        out: list[Optional[int]] = []
        held = 0
        for si in range(scales_run):
            held += schedule.tokens(si)
            f = schedule.from_end(si)
            if isinstance(c.budget, tuple):
                b = c.budget[len(c.budget) - f] if 1 <= f <= len(c.budget) else None
            else:
                b = c.budget if f >= 1 else None
            keep = None
            if b is not None and si < scales_run - 1 and held > c.min_tokens:
                h, w = schedule.hw[si]
                keep = max(len(window_positions(h, w, c.window)), int(b * schedule.offsets[si + 1] + 0.5))
                if keep >= held:
                    keep = None
            if keep is not None:
                held = keep
            out.append(keep)
        assert len(out) == scales_run <= S
        return out

    def kv_slots(self, info, scales_run: int):
        if self.config.neutral:
            return None
        sch, n = info.schedule, scales_run
        keep = self._keep(sch, n)
        if all(k is None for k in keep):
            return None
        refiner, held = [], 0
        for si in range(n):
            held = keep[si] if keep[si] is not None else held + sch.tokens(si)
            refiner.append(held)
        dense = list(sch.offsets[1:n + 1])
        drafters = set(self.config.drafters)
        return tuple(tuple(dense) if i in drafters else tuple(refiner) for i in range(info.num_layers))

    def begin(self, run) -> None:
        n = run.policies.scales_run(run.schedule.num_scales)
        keep = self._keep(run.schedule, n)
        slots = run.kv_slots
        st = run.policy_state.setdefault(self.name, {})
        st["keep"] = keep
        st["first"] = next((si for si, k in enumerate(keep) if k is not None), None)
        # the keys a query reads at each scale, averaged over the layers (ScaleStats.keys_read)
        st["keys"] = None if slots is None else [
            sum((s[si - 1] if si else 0) + run.schedule.tokens(si) for s in slots) / len(slots) for si in range(n)]
        st["refiners"] = frozenset(i for i in range(run.info.num_layers) if i not in self.config.drafters)

    def plan_scale(self, si: int, run) -> Optional[ScalePlan]:
        st = run.policy_state[self.name]
        if st["first"] is None or si < st["first"] or si >= len(st["keep"]):
            return ScalePlan(hooks=frozenset(), static=True)
        compress = st["keep"][si] is not None
        hooks = frozenset(("attention", "after_scale") if compress else ("after_scale",))
        tensors = {}
        if compress:
            h, w = run.schedule.hw[si]
            key = ("scalekv.window", h, w, self.config.window, str(run.device))
            cache = run.shape_cache
            if key not in cache:
                cache[key] = torch.tensor(window_positions(h, w, self.config.window), device=run.device)
            tensors["scalekv.window"] = cache[key]
        return ScalePlan(hooks=hooks, layers=st["refiners"], static=True, tensors=tensors)

    def attention(self, ctx, q_RHld, k_RHLd, v_RHLd, run):
        if ctx.kind != "self_attn":
            return None
        kv = run.workspace.kv
        out = dense_attention(q_RHld, k_RHLd, v_RHLd, scale=1.0, attn_mask=kv.key_mask(ctx.layer))
        keep = run.policy_state[self.name]["keep"][ctx.si]
        kv.compact(ctx.layer, self.select(q_RHld, k_RHLd, run.plan.tensors["scalekv.window"], keep))
        return out

    def select(self, q_RHld: torch.Tensor, k_RHLd: torch.Tensor, window_w: torch.Tensor, keep: int) -> torch.Tensor:
        """(R, H, keep) cache slots to keep, increasing: the window's keys and the ``keep − window``
        others whose summed, max-pooled logits from the window's queries are highest. ``q`` holds
        the current scale's queries, whose keys are the last ``l`` slots of ``k``."""
        R, H, l, _ = q_RHld.shape
        L = k_RHLd.shape[2]
        win_slots_w = window_w + (L - l)
        qw_RHwd = q_RHld.index_select(2, window_w).float()
        logits_RHwL = qw_RHwd @ k_RHLd.float().transpose(-1, -2)
        logits_RHwL.index_fill_(3, win_slots_w, float("-inf"))
        score_RHL = logits_RHwL.sum(2)
        k = self.config.pool_kernel
        if k > 1:
            score_RHL = F.max_pool1d(score_RHL, k, stride=1, padding=k // 2)
        score_RHL.index_fill_(2, win_slots_w, float("-inf"))
        rest_RHk = score_RHL.topk(keep - window_w.numel(), dim=-1).indices
        idx_RHn = torch.cat((rest_RHk, win_slots_w.expand(R, H, -1)), dim=-1)
        return idx_RHn.sort(dim=-1).values

    def after_scale(self, si, guided_logits_BLV, run) -> None:
        keys = run.policy_state[self.name]["keys"]
        if keys is not None:
            run.keys_read = keys[si]
