"""GPU tier: CUDA graphs, half precision and memory hygiene. Needs a CUDA device; CI has none,
so these run on the GPU machine (``pytest -m gpu``)."""
from __future__ import annotations

import gc

import pytest
import torch
from safetensors.torch import load_file

from sparsevar import VARPipeline
from sparsevar.models.loading import load_var_transformer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (GPU tier)")]


def _assert_same_steps(got: list, want: list) -> None:
    """Per-scale tensors equal bit for bit, and both runs produced the same, non-zero number of scales."""
    assert len(got) == len(want) > 0, (len(got), len(want))
    for si, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"scale {si} differs"


def _codes(pipe, labels, seed, **kw):
    got = []
    out = pipe(labels, generator=torch.Generator("cuda").manual_seed(seed), output_type="pt",
               callback_on_step_end=lambda p, si, t, k: got.append(k["codes"].clone()), **kw)
    return got, out.images


def test_fixture_greedy_run_on_cuda_with_and_without_graphs(var_official_files, var_fixture_dir, var_fixture_config):
    """fp32 on the GPU with CUDA graphs reproduces the official greedy codes exactly (TF32 is off
    by default in torch for float32 matmuls, and the fixtures keep a 1e-3 top-1 margin)."""
    ar = load_file(var_fixture_dir / "var_ar.safetensors")
    pipe = VARPipeline.from_single_file(var_official_files["var"], var_official_files["vae"]).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    labels = ar["label_B"].tolist()
    for i, run in enumerate(var_fixture_config["ar_runs"]):
        if run["top_k"] != 1:
            continue
        for graphs in (False, True, True):          # eager, capture, replay
            codes, _ = _codes(pipe, labels, 0, guidance_scale=run["cfg"], top_k=1, top_p=0.0, use_cuda_graphs=graphs)
            for k, c in enumerate(codes):
                assert torch.equal(c.cpu(), ar[f"r{i}.idx_s{k}"]), (i, graphs, k)


@pytest.mark.parametrize("kernels", ["triton", "compile"])
def test_compiled_elementwise_ops_reproduce_the_fixture_greedy_codes(var_official_files, var_fixture_dir,
                                                                    var_fixture_config, kernels):
    """Fused elementwise steps (hand-written Triton kernels, or torch.compile) round differently
    from eager, but in fp32 stay far inside the fixtures' 1e-3 top-1 margin: the greedy codes must
    be exactly the official ones."""
    ar = load_file(var_fixture_dir / "var_ar.safetensors")
    pipe = VARPipeline.from_single_file(var_official_files["var"], var_official_files["vae"]).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    pipe.set_kernels(kernels)
    labels = ar["label_B"].tolist()
    for i, run in enumerate(var_fixture_config["ar_runs"]):
        if run["top_k"] != 1:
            continue
        for graphs in (False, True, True):
            codes, _ = _codes(pipe, labels, 0, guidance_scale=run["cfg"], top_k=1, top_p=0.0, use_cuda_graphs=graphs)
            for k, c in enumerate(codes):
                assert torch.equal(c.cpu(), ar[f"r{i}.idx_s{k}"]), (i, graphs, k)


def test_cuda_graphs_give_the_same_images_as_eager_in_bfloat16():
    pipe = VARPipeline.from_random("var-tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    eager_codes, eager = _codes(pipe, [1, 2, 3], 7, use_cuda_graphs=False)
    for _ in range(2):                               # first call captures, second replays
        codes, images = _codes(pipe, [1, 2, 3], 7, use_cuda_graphs=True)
        _assert_same_steps(codes, eager_codes)
        torch.testing.assert_close(images, eager, atol=0, rtol=0)


def test_bfloat16_teacher_forced_logits_stay_close_to_the_reference(var_official_files, var_fixture_dir):
    """bf16 weights: compare teacher-forced logits only (generation may flip near-tied tokens).
    Tolerance: the fixture logits have std ≈ 2; cosine attention multiplies q·k (bf16, ~3
    significant digits) by temperatures up to 100, so errors of a few tenths are expected —
    we require a mean error under 2.5% of the logit std and a max under 0.75."""
    tf = load_file(var_fixture_dir / "var_tf.safetensors")
    x = load_file(var_fixture_dir / "vqvae.safetensors")["x_BLCv_wo_first_l"].cuda()
    model = load_var_transformer(var_official_files["var"], dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        logits = model(tf["label_B"].cuda(), x).cpu()
    err = (logits - tf["var.logits_BLV"]).abs()
    print(f"bf16 teacher-forced logits: max abs err {err.max():.4f}, mean {err.mean():.5f}")
    assert err.mean() < 0.05 and err.max() < 0.75


def test_interrupt_and_release_leave_no_gpu_memory_behind():
    pipe = VARPipeline.from_random("var-tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    pipe([1], generator=torch.Generator("cuda").manual_seed(0))   # creates the per-stream cuBLAS workspaces
    pipe.release_memory()
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()

    def boom(p, si, t, kw):
        if si == 4:
            raise KeyboardInterrupt("user interrupt")
        return kw

    interrupted = False
    try:
        pipe([1], generator=torch.Generator("cuda").manual_seed(0), callback_on_step_end=boom)
    except KeyboardInterrupt:
        interrupted = True        # leaving the except block drops the traceback and its frames
    assert interrupted
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base, "the interrupted run left its KV cache allocated"
    out = pipe([1], generator=torch.Generator("cuda").manual_seed(0), output_type="pt")   # next run works
    assert out.images.shape[0] == 1
    del out                       # the returned images are the caller's memory
    pipe.release_memory()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base


@pytest.mark.parametrize("enable", [
    lambda p: p.enable_sparsevar(keep_ratio=0.5, start_scale=-3),
    lambda p: p.enable_sparsevar(tau=0.5, start_scale=-3),
    lambda p: p.enable_fastvar(),
    lambda p: p.enable_scale_skip(skip_last=1, cond_only_from=-3),
    lambda p: p.enable_scalekv(budget=0.3, min_tokens=0),
    lambda p: p.enable_scalekv(budget=0.3, min_tokens=0).enable_scale_skip(skip_last=1, cond_only_from=-3),
], ids=["sparsevar-keep", "sparsevar-tau", "fastvar", "skip+cond-only", "scalekv", "scalekv+skip+cond-only"])
def test_policies_with_cuda_graphs_match_eager(enable):
    """Graphs replay only the scales no policy touches; the result must not depend on them."""
    pipe = VARPipeline.from_random("var-tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    enable(pipe)
    eager_codes, eager = _codes(pipe, [1, 2], 3, use_cuda_graphs=False)
    for _ in range(2):
        codes, images = _codes(pipe, [1, 2], 3, use_cuda_graphs=True)
        _assert_same_steps(codes, eager_codes)
        torch.testing.assert_close(images, eager, atol=0, rtol=0)


def test_sparsevar_whole_scale_replays_read_this_generations_plan():
    """SparseVAR's pruned scales replay whole (selection and anchor matching run before, the kept
    set, anchor copies and zero mask reach the graph through workspace buffers, the change map
    comes back from it): a replay for other classes and seeds must give that generation's eager
    codes, not the captured one's, and a changed setting must recapture."""
    pipe = VARPipeline.from_random("var-tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    pipe.set_kernels("triton")
    pipe.enable_sparsevar(keep_ratio=0.5, start_scale=-3)
    _codes(pipe, [1, 2], 11, use_cuda_graphs=True)                       # capture
    for labels, seed in (([5, 7], 3), ([0, 9], 4)):
        codes, images = _codes(pipe, labels, seed, use_cuda_graphs=True)  # replay
        eager_codes, eager = _codes(pipe, labels, seed, use_cuda_graphs=False)
        _assert_same_steps(codes, eager_codes)
        torch.testing.assert_close(images, eager, atol=0, rtol=0)
    ws = pipe.adapter()._workspace
    before = {k for k in ws.graphs if k[0] == "scale" and len(k) > 2}
    assert before, "SparseVAR's scales were not captured whole"
    pipe.enable_sparsevar(keep_ratio=0.5, start_scale=-3, block=0)       # another observed layer
    codes, _ = _codes(pipe, [5, 7], 3, use_cuda_graphs=True)
    eager_codes, _ = _codes(pipe, [5, 7], 3, use_cuda_graphs=False)
    _assert_same_steps(codes, eager_codes)
    assert {k for k in ws.graphs if k[0] == "scale" and len(k) > 2} - before, "the new setting was not recaptured"
    pipe.release_memory()


@pytest.mark.parametrize("policy", [None, "sparsevar", "fastvar"])
def test_whole_scale_graphs_give_the_eager_codes_and_follow_the_settings(policy):
    """With fused ops, a dense scale no policy acts on replays compute, guidance, sampling (its
    Exp(1) noise drawn just before) and the latent update as one graph: same codes and images as
    eager, under top-k / top-p sampling; a change of the baked-in settings recaptures."""
    pipe = VARPipeline.from_random("var-tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    pipe.set_kernels("triton")
    if policy == "sparsevar":
        pipe.enable_sparsevar(keep_ratio=0.5, start_scale=-3)
    elif policy == "fastvar":
        pipe.enable_fastvar()                        # published schedule: the last two scales pruned
    for cfg in (4.0, 1.5):
        kw = dict(guidance_scale=cfg, top_k=50, top_p=0.9)
        eager_codes, eager = _codes(pipe, [1, 2], 11, use_cuda_graphs=False, **kw)
        for _ in range(2):                           # capture, replay
            codes, images = _codes(pipe, [1, 2], 11, use_cuda_graphs=True, **kw)
            _assert_same_steps(codes, eager_codes)
            torch.testing.assert_close(images, eager, atol=0, rtol=0)
        ws = pipe.adapter()._workspace
        whole = sorted(k[1] for k in ws.graphs if k[0] == "scale")
        S = pipe.adapter().schedule.num_scales
        # every scale replays whole: SparseVAR's hooks are captured with their scales (the feeding
        # one and the three pruned ones, keep ratio: fixed subset sizes), FastVAR's with its cache
        # scale and the two pruned ones after it (fixed-size selections, the cache put back after
        # each replay of its scale)
        want = list(range(S))
        assert whole == want
        assert ws.scale_graph_settings[0].guidance_scale == cfg          # (settings, the adapter's constants)
    pipe.release_memory()


def test_fastvar_after_a_replayed_cache_scale_runs_later_scales_eagerly():
    """Call 1 captures FastVAR's graphs; call 2 makes the last scale cond-only (eager): it must read
    the cache refreshed by the replayed cache scale (review finding G1), and match an all-eager run."""
    pipe = VARPipeline.from_random("var-tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    pipe.enable_fastvar()
    _codes(pipe, [1, 2], 5, use_cuda_graphs=True)
    pipe.enable_scale_skip(cond_only_from=-1)
    codes, images = _codes(pipe, [1, 2], 5, use_cuda_graphs=True)
    eager_codes, eager = _codes(pipe, [1, 2], 5, use_cuda_graphs=False)
    _assert_same_steps(codes, eager_codes)
    torch.testing.assert_close(images, eager, atol=0, rtol=0)
    pipe.disable_scale_skip().enable_scale_skip(skip_last=1)          # a shorter call, then the full one
    _codes(pipe, [1, 2], 5, use_cuda_graphs=True)
    pipe.disable_scale_skip()
    full, full_images = _codes(pipe, [1, 2], 5, use_cuda_graphs=True)
    ref, ref_images = _codes(pipe, [1, 2], 5, use_cuda_graphs=False)
    _assert_same_steps(full, ref)


def test_graphs_are_recaptured_after_the_weights_move():
    """Graphs hold weight addresses; offloading and reloading (ComfyUI does) must not replay stale
    ones (review finding G2)."""
    pipe = VARPipeline.from_random("var-tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    before_codes, before = _codes(pipe, [3], 9, use_cuda_graphs=True)
    pipe.to("cpu")
    pipe.to("cuda")
    after_codes, after = _codes(pipe, [3], 9, use_cuda_graphs=True)
    _assert_same_steps(before_codes, after_codes)
    torch.testing.assert_close(after, before, atol=0, rtol=0)


def test_the_decode_replays_from_one_graph_and_hands_out_copies():
    """With graphs the VQVAE decode replays from a graph captured at the first call (the same
    pictures as eager); each call's images are a copy of the graph's output buffer, which the next
    replay overwrites; a VQVAE moved to another dtype on its own gets a new workspace (the scales'
    graphs read its codebook and φ: before, they replayed the old storage) with its own decode graph."""
    pipe = VARPipeline.from_random("var-tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    _, eager3 = _codes(pipe, [1, 2], 3, use_cuda_graphs=False)
    _, eager4 = _codes(pipe, [1, 2], 4, use_cuda_graphs=False)
    _, first = _codes(pipe, [1, 2], 3, use_cuda_graphs=True)
    _, second = _codes(pipe, [1, 2], 4, use_cuda_graphs=True)
    torch.testing.assert_close(first, eager3, atol=0, rtol=0)             # not overwritten by the second call
    torch.testing.assert_close(second, eager4, atol=0, rtol=0)
    ws = pipe.adapter()._workspace
    decode = [e for k, e in ws.graphs.items() if k[0] == "decode"]
    assert len(decode) == 1
    assert decode[0].out.data_ptr() not in (first.data_ptr(), second.data_ptr())
    pipe.vqvae.to(torch.float16)
    _, eager_half = _codes(pipe, [1, 2], 3, use_cuda_graphs=False)
    _, graphed_half = _codes(pipe, [1, 2], 3, use_cuda_graphs=True)
    torch.testing.assert_close(graphed_half, eager_half, atol=0, rtol=0)
    moved = pipe.adapter()._workspace            # the scales' graphs read the VQVAE too: a new workspace
    decode_keys = [k for k in moved.graphs if k[0] == "decode"]
    assert moved is not ws and len(decode_keys) == 1, decode_keys
    pipe.release_memory()


def test_ffn_gelu_epilogue_matches_the_two_step_path_in_bfloat16():
    """On CUDA the FFN applies bias + tanh-GELU inside cuBLASLt's matrix product; it must equal
    fc1 → GELU(tanh) → fc2 within bf16 rounding (the fused path rounds the activation once, the
    two-step path twice: differences of a few bf16 steps of the output scale)."""
    from sparsevar.models._blocks import TanhGeluFFN
    torch.manual_seed(0)
    ffn = TanhGeluFFN(256, 1024).cuda().to(torch.bfloat16)
    for shape in [(2, 1, 256), (2, 37, 256), (16, 256, 256)]:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            got = ffn(x)
        ffn(x.requires_grad_()).sum().backward()                 # training takes the differentiable path
        assert x.grad is not None and torch.isfinite(x.grad).all()
        x = x.detach()
        want = ffn.fc2(torch.nn.functional.gelu(ffn.fc1(x), approximate="tanh"))
        ref64 = torch.nn.functional.linear(
            torch.nn.functional.gelu(torch.nn.functional.linear(x.double(), ffn.fc1.weight.double(),
                                                                ffn.fc1.bias.double()), approximate="tanh"),
            ffn.fc2.weight.double(), ffn.fc2.bias.double())
        err_fused, err_two = (got.double() - ref64).abs().max(), (want.double() - ref64).abs().max()
        assert err_fused <= 1.5 * err_two + 1e-3, (shape, float(err_fused), float(err_two))


def test_compiled_steps_past_dynamos_recompile_limit_still_run():
    """Every pipeline of a process (the kernels are the default on a GPU) compiles its own variants
    of the same torch.compile'd steps, and Dynamo counts them per function, across instances: past
    its limit (8) a step must keep working (the plain-torch step), not fail. Twelve calls of the
    gated residual, each on a new Kernels instance, in nine variants Dynamo compiles apart (three
    dtypes × three ranks), give the plain result each time."""
    from sparsevar.sparse_ops.kernels import Kernels, gated_residual
    g = torch.Generator("cuda").manual_seed(0)
    variants = [(dtype, shape) for dtype in (torch.float32, torch.bfloat16, torch.float16)
                for shape in ((2, 7, 64), (3, 5, 32), (2, 3, 5, 16), (4, 6))]
    try:
        for i, (dtype, shape) in enumerate(variants):
            ops = Kernels(("triton", "compile")[i % 2])
            x, b = (torch.randn(*shape, device="cuda", generator=g).to(dtype) for _ in range(2))
            gate = torch.randn(*shape[:-2], 1, shape[-1], device="cuda", generator=g).to(dtype)
            torch.testing.assert_close(ops.gated_residual(x, b, gate), gated_residual(x, b, gate))
    finally:
        torch._dynamo.reset()          # the later tests of the process get Dynamo's whole budget back


def test_fused_linear_row_blocks_match_one_product_in_bfloat16():
    """Under the fused ops a long reduction on CHUNK_ROWS < rows < 2·CHUNK_ROWS runs through cuBLAS
    in two row blocks (``Kernels._fused_linear``): every row is still one bf16 product with
    float32 accumulation, so its error against float64 stays within 2× that of a single
    ``F.linear`` plus one bf16 step; other shapes, GELU and autograd take the single product."""
    from sparsevar.sparse_ops.kernels import Kernels
    ops = Kernels("triton")
    chunk = Kernels.CHUNK_ROWS
    g = torch.Generator("cuda").manual_seed(0)
    w = torch.randn(192, 1536, device="cuda", generator=g).to(torch.bfloat16) * 0.03
    b = torch.randn(192, device="cuda", generator=g).to(torch.bfloat16)
    for rows in (chunk + 1, chunk + 288, 2 * chunk - 1):
        x = torch.randn(1, rows, 1536, device="cuda", generator=g).to(torch.bfloat16)
        for bias in (b, None):
            with torch.no_grad():
                got = ops.linear(x, w, bias)
            want = torch.nn.functional.linear(x, w, bias)
            ref64 = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
            assert got.shape == want.shape == (1, rows, 192) and got.dtype == torch.bfloat16
            err, err_one = (got.double() - ref64).abs().max().item(), (want.double() - ref64).abs().max().item()
            assert err <= 2 * err_one + torch.finfo(torch.bfloat16).eps * ref64.abs().max().item(), (rows, err, err_one)


def test_fused_linear_pads_rows_from_the_gpus_table():
    """Under the fused ops a cuBLAS product at a row count that this GPU's shipped table lists runs
    on the padded count (``sparse_ops.gemm_rows``): its rows are bit for bit those of the padded
    product, spare rows full of NaN never reach them, and against float64 it errs within 2× a plain
    ``F.linear`` (+ GELU) plus one bf16 step — another cuBLAS kernel, the same precision."""
    from sparsevar.sparse_ops.kernels import Kernels
    from sparsevar.sparse_ops.gemm_rows import GemmRowTable, empty_rows, linear_rows, spare_rows

    table = GemmRowTable.for_device("cuda")
    if table is None:
        pytest.skip(f"no GEMM row table ships for {torch.cuda.get_device_name()} (bench_gemm_rows writes one)")
    ops = Kernels("triton")
    g = torch.Generator("cuda").manual_seed(0)
    for epilogue in ("bias", "gelu"):
        key, entries = max(((k, t) for k, t in table.entries.items() if k.endswith(":" + epilogue) and t),
                           key=lambda kt: len(kt[1]))
        N, K = (int(v) for v in key.split(":")[0].split("x"))
        M, M_pad = next((m, mp) for m, mp in sorted(entries.items()) if m > Kernels.SMALL_GEMM_ROWS)
        w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        b = torch.randn(N, device="cuda", generator=g).to(torch.bfloat16)
        x = empty_rows((M, K), dtype=torch.bfloat16, device="cuda")
        x.copy_(torch.randn(M, K, device="cuda", generator=g))
        x.as_strided((M + spare_rows(x), K), (K, 1)).narrow(0, M, spare_rows(x)).fill_(float("nan"))
        gelu = epilogue == "gelu"
        with torch.no_grad():
            got = ops.linear(x, w, b, gelu)
            padded = linear_rows(x, w, b, gelu, rows=M_pad)
        assert got.shape == (M, N) and torch.isfinite(got).all() and torch.equal(got, padded), (key, M, M_pad)
        plain = torch.nn.functional.linear(x, w, b)
        ref64 = torch.nn.functional.linear(x.double(), w.double(), b.double())
        if gelu:
            plain = torch.nn.functional.gelu(plain, approximate="tanh")
            ref64 = torch.nn.functional.gelu(ref64, approximate="tanh")
        err, err_plain = (got.double() - ref64).abs().max().item(), (plain.double() - ref64).abs().max().item()
        assert err <= 2 * err_plain + torch.finfo(torch.bfloat16).eps * ref64.abs().max().item(), (key, err, err_plain)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_vqvae_decode_runs_channels_last_and_errs_like_channels_first(dtype):
    """HART's tokenizer width (160 channels, 5 per group) at 256²: the half-precision decode runs
    channels-last on the fused norms with the convolutions' biases folded into them, and its error
    against the float64 decode is at most twice that of the same weights run channels-first (the
    modules as they are: each convolution adds its bias, the norms unfused or channels-first)."""
    from sparsevar.models.vqvae import MultiScaleVQVAE
    torch.manual_seed(0)
    vq = MultiScaleVQVAE(vocab_size=4096, z_channels=32, ch=160, ch_mult=(1, 1, 2, 2, 4), num_res_blocks=2,
                         patch_nums=(1, 2, 4, 8, 16)).eval().cuda()
    with torch.no_grad():
        for name, p in vq.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)                            # the folding moves the biases: make them count
        f_hat = torch.randn(1, 32, 16, 16, device="cuda")
        oracle = vq.double().fhat_to_img(f_hat.double())
        vq.to(dtype)
        fast = vq.fhat_to_img(f_hat)
        z = vq.post_quant_conv(f_hat.to(dtype))                              # the same decode, channels-first
        plain = vq.decoder(z.contiguous()).clamp(-1, 1)
    assert fast.shape == oracle.shape == (1, 3, 256, 256) and fast.is_contiguous()
    e_fast, e_plain = (fast.double() - oracle).abs().max().item(), (plain.double() - oracle).abs().max().item()
    assert e_plain > 0 and e_fast <= 2 * e_plain + 1e-3, (e_fast, e_plain)
    assert oracle.std() > 0.05                                               # a picture, not a constant
