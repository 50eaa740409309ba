"""HART on the GPU (``pytest -m gpu``): the fixture's greedy generation in float32 on CUDA, and the
best-estimate release size (depth 24, width 1536, random weights) at 1024² in bf16 with every policy."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from sparsevar import HARTPipeline

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier)")]


def test_fixture_greedy_generation_on_cuda_float32(hart_official_files, hart_fixture_dir):
    """float32 on the GPU (TF32 off) draws the fixture's greedy codes of every scale."""
    from sparsevar.engine.sampler import generate
    from sparsevar.engine.state import SamplingSettings
    from sparsevar.models.hart import HARTAdapter, HARTConditioning
    from sparsevar.models.loading import load_hart_tokenizer, load_hart_transformer
    adapter = HARTAdapter(load_hart_transformer(hart_official_files["llm"]).cuda().eval(),
                          load_hart_tokenizer(hart_official_files["tokenizer"]).cuda().eval())
    inputs = load_file(hart_fixture_dir / "inputs.safetensors")
    want = load_file(hart_fixture_dir / "infer_cfg4.5.safetensors")
    noise = (want["diff_noise_init"].cuda(), [s.cuda() for s in want["diff_noise_steps"]])
    cond = HARTConditioning(inputs["context"].cuda(), inputs["context_position_ids"].cuda(),
                            inputs["context_mask"].cuda(), noise)
    codes = []
    torch.backends.cuda.matmul.allow_tf32 = False
    out = generate(adapter, cond, 2, settings=SamplingSettings(guidance_scale=4.5, top_k=1, top_p=0.0),
                   generator=torch.Generator("cuda").manual_seed(0), callback=lambda si, d: codes.append(d["codes"].cpu()))
    for si, c_ in enumerate(codes):
        assert torch.equal(c_, want[f"tokens_s{si}"]), si
    torch.testing.assert_close(out.images.cpu(), want["image"], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("setup", ["dense", "sparsevar", "fastvar", "sparvar", "skip"])
def test_hart_0_7b_real_size_random_weights_1024px(setup):
    pipe = HARTPipeline.from_random("hart-0.7b", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    pipe.set_kernels("triton")
    {"dense": lambda: None, "sparsevar": pipe.enable_sparsevar, "fastvar": pipe.enable_fastvar,
     "sparvar": pipe.enable_sparvar, "skip": lambda: pipe.enable_scale_skip(skip_last=1)}[setup]()
    out = pipe("w3 w4 w5 w6", generator=torch.Generator("cuda").manual_seed(0), output_type="pt")
    assert out.images.shape == (1, 3, 1024, 1024) and torch.isfinite(out.images).all()
    st = out.stats[0]
    assert len(st.scales) == 14
    print(setup, st.table())
    pipe.release_memory()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_diffusion_head_tracks_the_plain_one(dtype):
    """The diffusion MLP at the release size (width 1024, 6 blocks, random weights) with each block's
    gated residual, LayerNorm and AdaLN in one Triton step: within twice the plain path's error
    against the float64 net, in bf16 and float32."""
    from sparsevar.models.hart import DiffusionMLP
    from sparsevar.sparse_ops.kernels import Kernels
    g = torch.Generator().manual_seed(0)
    net = DiffusionMLP(32, 1536, 1024, 6)
    with torch.no_grad():
        for p in net.parameters():                  # nn's default init, bias and LayerNorm included
            p.copy_(torch.randn(p.shape, generator=g) * (0.02 if p.dim() > 1 else 0.3) + (1.0 if p.dim() == 1 and
                                                                                           p.shape[0] == 1024 else 0.0))
    x, z = torch.randn(4096, 32, generator=g), torch.randn(4096, 1536, generator=g)
    t = torch.full((4096,), 499)
    with torch.no_grad():
        want = net.double()(x.double(), t, z.double())
        net = net.to("cuda", dtype)
        args = (x.to("cuda", dtype), t.cuda(), z.to("cuda", dtype))
        plain = net(*args).double().cpu()
        fused = net(*args, Kernels("triton").token_residual_norm_modulate).double().cpu()
    e_plain, e_fused = (plain - want).abs().max().item(), (fused - want).abs().max().item()
    assert e_fused <= 2 * e_plain + 1e-6 * want.abs().max().item(), (e_fused, e_plain)
    assert not torch.equal(plain, fused)                # the fused step ran


def _codes(pipe, prompts, graphs, seed=3):
    got = []
    out = pipe(prompts, generator=torch.Generator("cuda").manual_seed(seed), use_cuda_graphs=graphs, output_type="pt",
               callback_on_step_end=lambda p, si, t, d: got.append(d["codes"].clone()))
    return got, out.images


@pytest.mark.parametrize("setup", [
    lambda p: p,
    lambda p: p.enable_sparsevar(keep_ratio=0.5, start_scale=-3, block=1),      # the tiny model has 2 layers
    lambda p: p.enable_fastvar(),
    lambda p: p.enable_scale_skip(skip_last=1),
], ids=["dense", "sparsevar-keep", "fastvar", "skip"])
def test_graphs_replay_eager_codes_exactly(setup):
    """HART's scales replay from graphs (text scale included), the last computed one whole: compute,
    sampling with the smooth mixture, and the diffusion head with its draws. The codes and the image
    equal the eager run's bit for bit, at the capturing call and at a replaying one that captures
    nothing new; prompts of two lengths (the text's padding)."""
    pipe = HARTPipeline.from_random("hart-tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    setup(pipe)
    prompts = ["w3 w4 w5 w6", "w7 w8"]
    eager, img_e = _codes(pipe, prompts, graphs=False)
    captured, img_c = _codes(pipe, prompts, graphs=True)
    ws = pipe.adapter()._workspace
    n_graphs = len(ws.graphs)
    assert len(eager) - 1 in {k[1] for k in ws.graphs if k[0] == "scale"}     # the last scale whole, the head's draws inside
    replayed, img_r = _codes(pipe, ["w9 w10 w11", "w12"], graphs=True)
    again, img_a = _codes(pipe, prompts, graphs=True)
    assert len(ws.graphs) == n_graphs                          # nothing captured again
    for a, b, c in zip(eager, captured, again):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(img_e, img_c) and torch.equal(img_e, img_a)
    assert not torch.equal(torch.cat([c.flatten(1) for c in replayed], 1), torch.cat([c.flatten(1) for c in again], 1))


@pytest.mark.parametrize("kind", ["triton", "compile"])
def test_fused_steps_track_the_plain_torch_steps(kind):
    """HART's per-layer steps under the fused kernels against the plain torch ones, bf16 in, on the
    shapes of a small and a large scale as the layer calls them: RMSNorm·AdaLN with and without the
    residual (the norm's weight folded into mul), rotate-half RoPE with the KV-cache write, SiLU·up."""
    from sparsevar.sparse_ops.kernels import TORCH_KERNELS as plain, Kernels
    fused = Kernels(kind)
    g = torch.Generator("cuda").manual_seed(0)
    for n in (4, 1296):
        x = torch.randn(2, n, 1536, device="cuda", generator=g) * 3
        branch = torch.randn(2, n, 1536, device="cuda", generator=g).bfloat16()
        gate, mul, shift = (torch.randn(2, 1, 1536, device="cuda", generator=g) for _ in range(3))
        torch.testing.assert_close(fused.modulate(x, mul, shift, 1e-6, torch.bfloat16, rms=True).float(),
                                   plain.modulate(x, mul, shift, 1e-6, torch.bfloat16, rms=True).float(),
                                   rtol=1.6e-2, atol=1e-2)
        for got, want in zip(fused.residual_modulate(x, branch, gate, mul, shift, 1e-6, torch.bfloat16, True),
                             plain.residual_modulate(x, branch, gate, mul, shift, 1e-6, torch.bfloat16, True)):
            torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
        qkv = torch.randn(2, n, 3, 24, 64, device="cuda", generator=g).bfloat16()
        half = torch.rand(2, n, 32, device="cuda", generator=g) * 6
        ang = torch.cat((half, half), dim=-1)
        outs = []
        for ops in (fused, plain):
            k_dst, v_dst = (torch.zeros(2, 24, n, 64, device="cuda", dtype=torch.bfloat16) for _ in "kv")
            outs.append((ops.rope_half_store(qkv, ang.cos(), ang.sin(), 0.125, k_dst, v_dst), k_dst, v_dst))
        for got, want in zip(*outs):
            torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=4e-3)
        assert torch.equal(outs[0][2], qkv[:, :, 2].transpose(1, 2))                      # v: a plain copy
        a, b = (torch.randn(2, n, 4096, device="cuda", generator=g).bfloat16() for _ in range(2))
        torch.testing.assert_close(fused.silu_mul(a, b).float(), plain.silu_mul(a, b).float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("kind", ["triton", "compile"])
def test_chained_dense_path_draws_what_a_neutral_wrapper_draws(kind, hart_official_files, hart_fixture_dir):
    """Dense runs the fused path (each output projection with its residual and the next RMSNorm,
    across block borders); a policy whose sub-layer wrapper runs each sub-layer as it is (the
    contract's default) takes the same kernels one sub-layer at a time: the fixture model on CUDA in
    float32 draws the same greedy codes at every scale and the same picture."""
    from sparsevar.engine.contract import Policy, PolicyStack, ScalePlan
    from sparsevar.engine.sampler import generate
    from sparsevar.engine.state import SamplingSettings
    from sparsevar.models.hart import HARTAdapter, HARTConditioning
    from sparsevar.models.loading import load_hart_tokenizer, load_hart_transformer

    class WrapEverySubLayer(Policy):
        name = "wrap-every-sub-layer"

        def plan_scale(self, si, run):
            return ScalePlan(hooks=frozenset({"wrap_sublayer"}), static=True)

    adapter = HARTAdapter(load_hart_transformer(hart_official_files["llm"]).cuda().eval(),
                          load_hart_tokenizer(hart_official_files["tokenizer"]).cuda().eval())
    adapter.set_kernels(kind)
    assert adapter.chains_layers()
    inputs = {k: v.cuda() for k, v in load_file(hart_fixture_dir / "inputs.safetensors").items()}
    runs = []
    for policies in ((), (WrapEverySubLayer(),)):
        codes = []
        cond = HARTConditioning(inputs["context"], inputs["context_position_ids"], inputs["context_mask"])
        out = generate(adapter, cond, 2, settings=SamplingSettings(guidance_scale=4.5, top_k=1, top_p=0.0),
                       generator=torch.Generator("cuda").manual_seed(0), policies=PolicyStack(policies),
                       callback=lambda si, d: codes.append(d["codes"].clone()))
        runs.append((codes, out.images))
    (dense, img_d), (neutral, img_n) = runs
    assert len(dense) == adapter.schedule.num_scales and all(torch.equal(a, b) for a, b in zip(dense, neutral))
    torch.testing.assert_close(img_n, img_d, rtol=0, atol=1e-5)
