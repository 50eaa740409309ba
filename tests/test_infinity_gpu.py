"""Infinity on the GPU: fixture parity in float32, bfloat16 blocks against the float32 reference, and
the real-size 2B model (random weights) at 1024 px. Needs a CUDA device (``pytest -m gpu``)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from sparsevar import InfinityPipeline
from sparsevar.models.infinity import infinity_resolution
from sparsevar.models.loading import load_infinity_transformer
from sparsevar.models.text_encoder import TextFeatures

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier)")]


def _words(ids, eos):
    return " ".join(f"w{int(i)}" for i in ids[:-1])


def test_fixture_greedy_runs_on_cuda_float32(infinity_official_files, infinity_fixture_dir, infinity_fixture_config):
    """float32 on the GPU (TF32 off) reproduces the greedy bits of every case: the fixtures keep a
    bit margin of 3e-4·cfg/tau, far above fp32 GPU rounding."""
    f, c = infinity_official_files, infinity_fixture_config
    ref = load_file(infinity_fixture_dir / "inference.safetensors")
    pipe = InfinityPipeline.from_single_file(f["transformer"], f["vae"], text_encoder=f["t5"]).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    res = infinity_resolution(c["h_div_w_template"], c["pn"])
    eos = c["t5"]["eos_token_id"]
    prompts = [_words(ids, eos) for ids in c["t5"]["prompts_token_ids"]]
    for name, case in c["inference_cases"].items():
        if case["top_k"] != 1:
            continue
        kw = dict(guidance_scale=case["cfg"], temperature=case["tau"], top_k=1, top_p=0.0)
        if case.get("negative"):
            kw["negative_prompt"] = _words(c["t5"]["negative_prompt_token_ids"], eos)
        got = []
        pipe(prompts, height=res.height, width=res.width, generator=torch.Generator("cuda").manual_seed(0),
             output_type="latent", callback_on_step_end=lambda p, si, t, d: got.append(d["codes"].cpu()) or d, **kw)
        assert torch.equal(torch.cat(got, 1).to(torch.uint8), ref[f"{name}.bits"]), name


def test_bfloat16_blocks_teacher_forced_logits_are_close(infinity_official_files, infinity_fixture_dir,
                                                         infinity_fixture_config):
    """The reference's bf16 mode (blocks in bf16, the rest float32): logits within a few 1e-2 relative."""
    c = infinity_fixture_config
    text = load_file(infinity_fixture_dir / "text.safetensors")
    tf = load_file(infinity_fixture_dir / "teacher_forced.safetensors")
    model = load_infinity_transformer(infinity_official_files["transformer"], dtype=torch.bfloat16).to("cuda")
    res = infinity_resolution(c["h_div_w_template"], c["pn"])
    feats = TextFeatures(text["kv_compact"], tuple(int(n) for n in text["lens"].tolist()))
    with torch.no_grad():
        logits = model(feats, tf["x_BLC_wo_prefix"].cuda(), res).cpu()
    ref = tf["logits"]
    rel = (logits - ref).norm() / ref.norm()
    assert rel < 3e-2, float(rel)
    agree = ((logits[..., 1::2] > logits[..., 0::2]) == (ref[..., 1::2] > ref[..., 0::2])).float().mean()
    assert agree > 0.98, float(agree)


def test_infinity_2b_real_size_random_weights_1024px():
    """The benchmark model: 2B at real size with random weights, bf16 blocks, 1024×1024, CFG on.
    Runs all 13 scales and decodes; per-scale times are in the stats."""
    pipe = InfinityPipeline.from_random("infinity-2b", dtype=torch.bfloat16, device="cuda")
    pipe.set_progress_bar_config(disable=True)
    out = pipe("w3 w4 w5 w6", height=1024, width=1024, generator=torch.Generator("cuda").manual_seed(0),
               output_type="pt")
    assert out.images.shape == (1, 3, 1024, 1024) and torch.isfinite(out.images).all()
    st = out.stats[0]
    assert len(st.scales) == 13 and st.tokens == 10521
    print(st.table())
    pipe.release_memory()


def test_absorbed_cross_attention_in_bf16_errs_like_the_projections():
    """Infinity-2B's cross-attention shapes (C 2048, 16 heads, a 20-token prompt padded to 32, 300
    queries) in bf16: the absorbed form's error against float32 stays within 2x that of the
    projections + SDPA in bf16 (both round their operands to bf16; the absorbed form keeps its logits
    in float32 as a flash kernel does)."""
    from sparsevar.models._blocks import CrossMemory
    from sparsevar.models.infinity import InfinityCrossAttention

    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator("cuda").manual_seed(0)
    C, H, T, Tb, l = 2048, 16, 20, 32, 300
    ca = InfinityCrossAttention(C, H).cuda()
    with torch.no_grad():
        for prm in ca.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g, device="cuda") * 0.02)
    text = torch.randn(2, Tb, C, generator=g, device="cuda")
    y = torch.randn(2, l, C, generator=g, device="cuda")
    valid = (torch.arange(Tb, device="cuda") < T)[None].expand(2, -1)
    with torch.no_grad():
        k, v = ca.text_kv(text)
        ref = ca(y, CrossMemory(k, v, valid[:, None, None, :]))
        ca16 = InfinityCrossAttention(C, H).cuda().to(torch.bfloat16)
        ca16.load_state_dict(ca.state_dict())
        k16, v16 = ca16.text_kv(text)
        std = ca16(y.bfloat16(), CrossMemory(k16, v16, valid[:, None, None, :])).float()
        absorbed = ca16(y.bfloat16(), ca16.absorb(k16, v16, valid)).float()
    err_std, err_abs = (std - ref).abs().max().item(), (absorbed - ref).abs().max().item()
    assert err_abs <= 2 * err_std, (err_abs, err_std)


# ---- CUDA graphs and the fused elementwise kernels ---------------------------------------------------
def _tiny_bf16():
    pipe = InfinityPipeline.from_random("infinity-tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _codes(pipe, prompts, graphs, seed=3, **kw):
    got = []
    pipe(prompts, height=256, width=256, generator=torch.Generator("cuda").manual_seed(seed), use_cuda_graphs=graphs,
         output_type="latent", callback_on_step_end=lambda p, si, t, d: got.append(d["codes"].clone()), **kw)
    return got


@pytest.mark.parametrize("absorb", ["never", "always"])
@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("setup", [
    lambda p: p,
    lambda p: p.enable_sparsevar(keep_ratio=0.5, start_scale=-3, block=0),      # the tiny model has 2 groups
    lambda p: p.enable_scale_skip(skip_last=1),
    lambda p: p.enable_scalekv(budget=0.3, min_tokens=50, drafters=(1,)),
], ids=["dense", "sparsevar-keep", "skip", "scalekv"])
def test_graphs_replay_eager_codes_exactly(kernels, setup, absorb):
    """Dense scales replay whole from graphs (compute, guidance, the bit draws, the latent), the
    policies' scales with their hooks inside where their plans are static: the sampled bits equal the eager run's bit for bit, at the capturing call and at a replaying one; with the
    cross-attention as projections and in its absorbed form."""
    pipe = _tiny_bf16()
    pipe.adapter().absorb_cross_attention = absorb
    pipe.set_kernels(kernels)
    setup(pipe)
    prompts = ["w3 w4 w5 w6", "w7 w8"]                       # two lengths: the text key mask is used
    eager = _codes(pipe, prompts, graphs=False)
    captured = _codes(pipe, prompts, graphs=True)
    ws = pipe.adapter()._workspace
    n_graphs = len(ws.graphs)
    assert n_graphs > 0
    if not len(pipe.policies):                                # dense: every scale whole, its bit draws inside
        assert {k[1] for k in ws.graphs if k[0] == "scale"} == set(range(len(eager)))
    replayed = _codes(pipe, prompts, graphs=True)
    assert len(ws.graphs) == n_graphs                         # nothing captured again
    for a, b, c in zip(eager, captured, replayed):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_zero_shot_size_replays_the_trained_scales_from_graphs():
    """At 2048² the 13 trained scales replay from graphs and the two zero-shot scales run eagerly;
    the codes equal a fully eager run's."""
    pipe = _tiny_bf16()
    kw = dict(height=2048, width=2048, generator=torch.Generator("cuda").manual_seed(1), top_k=1, output_type="latent")
    got = {}
    for graphs in (False, None):                     # None: the pipeline's default
        codes = []
        pipe("w3 w4", use_cuda_graphs=graphs, callback_on_step_end=lambda p, si, t, d: codes.append(d["codes"].clone()),
             **kw)
        got[graphs] = torch.cat([c.flatten(1) for c in codes], 1)
    ws = pipe.adapter()._workspace
    graphed = {k[1] for k in ws.graphs}
    assert graphed == set(range(13)), sorted(graphed)
    assert torch.equal(got[False], got[None])


@pytest.mark.parametrize("absorb", ["never", "always"])
def test_prompts_of_one_text_bucket_share_graphs(absorb):
    """Prompt lengths inside one 32-token bucket reuse the captured graphs (the text memory lives in
    static buffers, masked past each prompt); a new bucket captures new ones."""
    pipe = _tiny_bf16()
    pipe.adapter().absorb_cross_attention = absorb
    short = _codes(pipe, "w3 w4 w5", graphs=True)
    ws = pipe.adapter()._workspace
    assert ws.ca_absorbed == (absorb == "always")
    n_graphs, ptrs = len(ws.graphs), ws.text_buffers()
    other = _codes(pipe, "w9 w10 w11 w12 w13 w14 w15", graphs=True)
    assert len(ws.graphs) == n_graphs and ws.text_buffers() == ptrs
    assert torch.equal(torch.cat(other, 1), torch.cat(_codes(pipe, "w9 w10 w11 w12 w13 w14 w15", graphs=False), 1))
    assert not torch.equal(torch.cat(short, 1), torch.cat(other, 1))
    long_prompt = " ".join(f"w{i}" for i in range(3, 45))          # > 32 tokens: the next bucket
    long_codes = _codes(pipe, long_prompt, graphs=True)
    heads = pipe.transformer.config.num_heads
    assert (ws.ca_kq_NRMC.shape[2] // heads if ws.ca_absorbed else ws.ca_k_NRHTd.shape[3]) == 64
    assert torch.equal(torch.cat(long_codes, 1), torch.cat(_codes(pipe, long_prompt, graphs=False), 1))


def test_fused_elementwise_kernels_track_the_eager_path():
    """The fused Triton steps (LayerNorm + AdaLN with the residual add, q/k norm + RoPE + cache write)
    round in other places than eager torch: the first scale's logits agree to bf16 precision, and
    greedy bits of the first scales agree but for near-ties."""
    pipe = _tiny_bf16()
    out = {}
    for kernels in ("torch", "triton"):
        pipe.set_kernels(kernels)
        got = []
        pipe("w3 w4 w5 w6", height=256, width=256, generator=torch.Generator("cuda").manual_seed(0), top_k=1,
             output_type="latent", callback_on_step_end=lambda p, si, t, d: got.append((d["logits"].clone(),
                                                                                       d["codes"].clone())),
             callback_on_step_end_tensor_inputs=("logits", "codes"))
        out[kernels] = got
    l_eager, l_fused = out["torch"][0][0], out["triton"][0][0]
    rel = ((l_fused - l_eager).norm() / l_eager.norm()).item()
    assert rel < 2e-2, rel
    bits_e = torch.cat([c for _, c in out["torch"][:4]], 1)
    bits_f = torch.cat([c for _, c in out["triton"][:4]], 1)
    assert (bits_e == bits_f).float().mean() > 0.97


def test_sparvar_on_the_triton_backend_draws_the_torch_backends_codes():
    """SparVAR's GPU path (the gathered CS4A kernel, CSLA as gathered windows) on the tiny
    model in float32: the neutral setting draws dense's greedy codes, and an active setting the
    codes its torch path draws (SDPA with masks, the torch twin)."""
    from sparsevar import SparVARConfig
    pipe = InfinityPipeline.from_random("infinity-tiny", seed=1).to("cuda")
    pipe.set_progress_bar_config(disable=True)

    def run():
        codes = []
        pipe(["w3 w4 w5", "w9"], height=256, width=256, guidance_scale=3.0, top_k=1,
             generator=torch.Generator("cuda").manual_seed(0), output_type="latent",
             callback_on_step_end=lambda p, si, t, d: codes.append(d["codes"].cpu()) or d)
        return codes

    dense = run()
    pipe.enable_sparvar(SparVARConfig.dense(backend="triton"))
    neutral = run()
    pipe.disable_sparvar()
    active = dict(windows=(3, 1), sink_scales=2, top_keys=0.1)
    pipe.enable_sparvar(backend="triton", **active)
    on_triton = run()
    pipe.disable_sparvar()
    pipe.enable_sparvar(backend="torch", **active)
    on_torch = run()
    assert len(dense) == len(neutral) == len(on_triton) == len(on_torch) == 7
    assert all(torch.equal(a, b) for a, b in zip(neutral, dense))
    assert all(torch.equal(a, b) for a, b in zip(on_triton, on_torch))
    assert any(not torch.equal(a, b) for a, b in zip(on_triton, dense))


@pytest.mark.parametrize("mapping", ["relative", "verbatim"])
def test_sparvar_scales_replay_from_graphs_with_the_eager_codes_and_key_counts(mapping):
    """SparVAR's plans are static: its scales' compute (the decision scale's selection, the sparse
    scales' gathered kernels, the head) replays from CUDA graphs with the hooks inside, drawing the
    eager run's bits and counting the same keys, at the capturing call and at a replaying one."""
    pipe = _tiny_bf16()
    pipe.set_kernels("triton")
    pipe.enable_sparvar(windows=(3, 1), sink_scales=2, top_keys=0.1, mapping=mapping)
    prompts = ["w3 w4 w5 w6", "w7 w8"]

    def run(graphs):
        got = []
        out = pipe(prompts, height=256, width=256, generator=torch.Generator("cuda").manual_seed(3),
                   use_cuda_graphs=graphs, output_type="latent",
                   callback_on_step_end=lambda p, si, t, d: got.append(d["codes"].clone()))
        return got, [s.keys_read for s in out.stats[0].scales]

    eager, eager_keys = run(False)
    captured, captured_keys = run(True)
    ws = pipe.adapter()._workspace
    n_graphs = len(ws.graphs)
    replayed, replayed_keys = run(True)
    assert len(ws.graphs) == n_graphs
    S = len(eager)
    assert {k[1] for k in ws.graphs} == set(range(S))                    # a graph at every scale, SparVAR's too
    assert sum(k is not None for k in eager_keys) == 3
    assert captured_keys == pytest.approx(eager_keys) and replayed_keys == pytest.approx(eager_keys)
    for a, b, c in zip(eager, captured, replayed):
        assert torch.equal(a, b) and torch.equal(a, c)
