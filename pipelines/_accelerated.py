"""What every family's pipeline shares: the stack of acceleration policies, the diffusers-style
run properties and the image post-processing. Each pipeline supplies ``adapter()`` (its engine
adapter) and ``PRESET_FAMILY`` (the key of its presets in ``SPARSEVAR_PRESETS`` / ``FASTVAR_PRESETS``).
"""
from __future__ import annotations

import json
import logging
from typing import Optional

import numpy as np
import PIL.Image
import torch

from ..engine.contract import Policy, PolicyStack
from ..policies.fastvar import FASTVAR_PRESETS, FastVARConfig, FastVARPolicy
from ..policies.scale_skip import ScaleSkipConfig, ScaleSkipPolicy
from ..policies.sparsevar import SPARSEVAR_PRESETS, SparseVARConfig, SparseVARPolicy, _replace
from ..sparse_ops._backend import resolve_backend

logger = logging.getLogger(__name__)
LIBRARY_NAME = "sparsevar"   # written into model_index.json instead of a module path (see save_pretrained)


def check_call_arguments(generator, n_images: int, num_images_per_prompt, callback_on_step_end,
                         callback_on_step_end_tensor_inputs, allowed_tensor_inputs, policies,
                         images_are: str = "images") -> None:
    """The checks of a pipeline call that every family shares, made before any work: the types of
    ``num_images_per_prompt``, ``generator`` (None, a torch.Generator or one per image),
    ``callback_on_step_end`` (callable), its tensor inputs (a list of allowed names) and ``policies``
    (Policy objects). ``images_are`` says how ``n_images`` is counted. ValueError / TypeError naming
    the argument, the value and the fix."""
    if isinstance(num_images_per_prompt, (bool, np.bool_)):
        raise TypeError(f"num_images_per_prompt must be an int >= 1, got {num_images_per_prompt!r}")
    gens = generator if isinstance(generator, (list, tuple)) else [generator]
    if isinstance(generator, (list, tuple)) and len(generator) != n_images:
        raise ValueError(f"got {len(generator)} generators for {n_images} images; pass one generator, or one per "
                         f"image ({images_are} = {n_images})")
    wrong = [g for g in gens if g is not None and not isinstance(g, torch.Generator)]
    if wrong:
        raise TypeError(f"generator must be a torch.Generator (or a list of one per image), got "
                        f"{type(wrong[0]).__name__} {wrong[0]!r}; e.g. generator=torch.Generator().manual_seed(0)")
    if callback_on_step_end is not None and not callable(callback_on_step_end):
        raise TypeError(f"callback_on_step_end must be a function fn(pipe, step, timestep, callback_kwargs), got "
                        f"{type(callback_on_step_end).__name__} {callback_on_step_end!r}")
    if isinstance(callback_on_step_end_tensor_inputs, str):
        raise TypeError(f"callback_on_step_end_tensor_inputs must be a list of names, got the string "
                        f"{callback_on_step_end_tensor_inputs!r}; e.g. [{callback_on_step_end_tensor_inputs!r}]")
    bad = [k for k in (callback_on_step_end_tensor_inputs or []) if k not in allowed_tensor_inputs]
    if bad:
        raise ValueError(f"callback_on_step_end_tensor_inputs has {bad}; allowed: {list(allowed_tensor_inputs)}")
    if policies is not None:
        listed = isinstance(policies, (list, tuple))
        wrong = [q for q in (policies if listed else [policies]) if not isinstance(q, Policy)]
        if wrong or not listed:
            q = wrong[0] if wrong else policies
            wrap = {SparseVARConfig: "SparseVARPolicy", FastVARConfig: "FastVARPolicy",
                    ScaleSkipConfig: "ScaleSkipPolicy"}.get(type(q), "SparseVARPolicy")
            got = f"a {type(q).__name__}" + ("" if listed else ", not a list")
            raise TypeError(f"policies must be a list of Policy objects, got {got}; e.g. policies=[{wrap}(config)]")


class _DropCPUHalfWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "cannot run with `cpu` device" not in record.getMessage()


class AcceleratedPipelineMixin:
    """Policy management (``enable_sparsevar`` …) and run state shared by VARPipeline and
    InfinityPipeline. The subclass sets ``self._policies = PolicyStack()``, ``self._interrupt``,
    ``self._current_scale``, ``self._adapter`` and ``self._compiled_elementwise = False`` in its
    ``__init__``; its ``adapter()`` passes the last to the adapter's ``set_compiled_elementwise``."""

    PRESET_FAMILY: str = "var"

    def to(self, *args, **kwargs):
        """diffusers' ``to(device)`` / ``to(dtype)`` / ``to(device, dtype)``, with a device string
        that names no device (or a dtype given as a string), or the meta device (which holds no
        weights), refused in one line naming the value."""
        for value in (*args, kwargs.get("device"), kwargs.get("torch_device")):
            if not isinstance(value, (str, torch.device)):
                continue
            try:
                device = torch.device(value)
            except (RuntimeError, ValueError):
                key = value.strip().lower().removeprefix("torch.")
                hint = f"; for a dtype pass torch.{key}" if key in ("float32", "float16", "bfloat16", "half",
                                                                     "float") else ""
                raise ValueError(f"to({value!r}): not a device; pass 'cpu', 'cuda' or 'cuda:N' (or a torch.device)"
                                 f"{hint}") from None
            if device.type == "meta":
                raise ValueError(f"to({str(value)!r}): the meta device holds no weights, so the pipeline could not "
                                 f"generate again; pass 'cpu', 'cuda' or 'cuda:N'")
        diffusers_log = logging.getLogger("diffusers.pipelines.pipeline_utils")
        quiet = _DropCPUHalfWarning()            # diffusers says float16 cannot run on the CPU; here it does
        diffusers_log.addFilter(quiet)
        try:
            return super().to(*args, **kwargs)
        finally:
            diffusers_log.removeFilter(quiet)

    def save_pretrained(self, save_directory, safe_serialization: bool = True, **kwargs) -> None:
        """diffusers' ``save_pretrained``: ``model_index.json`` and one subfolder per component
        (safetensors). Our components are recorded under the library name ``sparsevar`` rather than
        the defining module's, which inside ComfyUI is a file-system path no other process could import.
        ``save_directory`` must be a folder (made if missing); an existing file there is refused."""
        from diffusers import ModelMixin

        from ..models.loading import local_path
        path = local_path(save_directory, "save_directory")
        if path.exists() and not path.is_dir():
            raise ValueError(f"save_directory={str(path)!r} is a file; pass a folder to write the pipeline into "
                             f"(it is made if missing)")
        super().save_pretrained(path, safe_serialization=safe_serialization, **kwargs)
        index_path = path / "model_index.json"
        index = json.loads(index_path.read_text())
        for name, module in self.components.items():
            if isinstance(module, ModelMixin):
                index[name] = [LIBRARY_NAME, type(module).__name__]
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    def enable_compiled_elementwise(self, enabled: bool = True, kernels: str = "fused") -> "AcceleratedPipelineMixin":
        """Fuse each block's small elementwise steps (LayerNorm + AdaLN, cosine q/k norm with the
        KV-cache write, gated residual) into single kernels. At batch 1 these steps, not the matrix
        products, dominate a VAR step; Infinity runs ~20 of them per layer at every scale. CUDA + Triton only.

        kernels: ``"fused"`` (default) runs the hand-written Triton kernels of
            ``sparse_ops.dense_fused`` (one launch per step), plus ``sparse_ops.linear`` for matrix
            products of ≤ 64 rows (there, on sm_90+, a layer's kernels are chained by programmatic
            dependent launch: ``sparse_ops._gdc``) and ``sparse_ops.sample`` for codebook sampling
            (filter and draw in one launch per scale); ``"compile"`` lets torch.compile fuse
            each step (the first call compiles for tens of seconds; one more launch per layer).
        """
        if kernels not in ("fused", "compile"):
            raise ValueError(f"kernels={kernels!r}: use 'fused' (hand-written Triton kernels) or 'compile' "
                             f"(torch.compile)")
        if enabled:
            if self.transformer.device.type != "cuda":
                raise ValueError("enable_compiled_elementwise needs the model on a CUDA device; call pipe.to('cuda') "
                                 "first (on CPU the eager path is used)")
            try:
                import triton  # noqa: F401
            except ImportError:
                raise ValueError("enable_compiled_elementwise needs Triton: pip install 'sparsevar[triton]'") from None
            if kernels == "fused" and resolve_backend("auto", self.transformer.device) != "triton":
                # e.g. a GPU older than sm_80 or ROCm: the hand-written kernels do not run, torch.compile does
                logger.warning("enable_compiled_elementwise: the fused Triton kernels cannot run on this device "
                               "(sparsevar info --backends says why); using kernels='compile' (torch.compile)")
                kernels = "compile"
        self._compiled_elementwise = kernels if enabled else False
        return self

    # ---- policies ---------------------------------------------------------------------------------
    @property
    def policies(self) -> PolicyStack:
        """The acceleration policies applied to every call (empty: dense generation)."""
        return self._policies

    def add_policy(self, policy: Policy):
        """Stack an acceleration policy. Its settings are checked against this model now; a policy
        of the same name is replaced; one that cannot be combined raises a ValueError naming what
        to disable."""
        policy.validate(self.adapter().model_info())
        self._policies = self._policies.without(policy.name).with_policy(policy)
        return self

    def remove_policy(self, name: str):
        self._policies = self._policies.without(name)
        return self

    def _config(self, config, cls, presets: dict, overrides: dict, method: str):
        if config is None:
            config = presets.get(self.PRESET_FAMILY, cls())
        elif not isinstance(config, cls):
            raise TypeError(f"{method}(config=...) takes a {cls.__name__}, got {type(config).__name__}")
        return _replace(config, overrides) if overrides else config

    def enable_sparsevar(self, config: Optional[SparseVARConfig] = None, **overrides):
        """Frequency-aware token exclusion with anchors. ``config`` defaults to the family preset
        (``SPARSEVAR_PRESETS``); keyword overrides change single fields, e.g. ``tau=0.5`` or
        ``keep_ratio=0.3``. Cannot be combined with FastVAR."""
        cfg = self._config(config, SparseVARConfig, SPARSEVAR_PRESETS, overrides, "enable_sparsevar")
        return self.add_policy(SparseVARPolicy(cfg))

    def disable_sparsevar(self):
        return self.remove_policy(SparseVARPolicy.name)

    def enable_fastvar(self, config: Optional[FastVARConfig] = None, **overrides):
        """Cached token pruning at the last scales. ``config`` defaults to the family preset
        (``FASTVAR_PRESETS``); e.g. ``ratios=(0.5, 0.75)``. Cannot be combined with SparseVAR."""
        cfg = self._config(config, FastVARConfig, FASTVAR_PRESETS, overrides, "enable_fastvar")
        return self.add_policy(FastVARPolicy(cfg))

    def disable_fastvar(self):
        return self.remove_policy(FastVARPolicy.name)

    def enable_scale_skip(self, config: Optional[ScaleSkipConfig] = None, *, skip_last: Optional[int] = None,
                          cond_only_from: Optional[int] = None):
        """Skip the last ``skip_last`` scales and/or run scales from ``cond_only_from`` (negative =
        from the end) without the unconditional half. Combines with SparseVAR or FastVAR."""
        overrides = {k: v for k, v in (("skip_last", skip_last), ("cond_only_from", cond_only_from)) if v is not None}
        cfg = self._config(config, ScaleSkipConfig, {}, overrides, "enable_scale_skip")
        return self.add_policy(ScaleSkipPolicy(cfg))

    def disable_scale_skip(self):
        return self.remove_policy(ScaleSkipPolicy.name)

    # ---- diffusers-style properties ---------------------------------------------------------------
    @property
    def current_timestep(self):
        return self._current_scale

    @property
    def interrupt(self) -> bool:
        return self._interrupt

    def release_memory(self) -> None:
        """Drop the KV caches (and CUDA graphs) kept for repeated calls."""
        if self._adapter is not None:
            self._adapter.release()

    @staticmethod
    def _postprocess(x: torch.Tensor, output_type: str):
        if output_type in ("pt", "latent"):
            return x
        arr = x.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()      # (B, 3, H, W) → (B, H, W, 3)
        if output_type == "np":
            return arr
        return [PIL.Image.fromarray((a * 255).round().astype(np.uint8)) for a in arr]
