"""Model CPU offload (issue #32, pipelines/offload.py): each component is on the GPU only while it
runs, the pictures equal those of a pipeline kept on the GPU, and the transformer's CUDA graphs
survive from call to call. The GPU tests run on the GPU machine; the refusal runs everywhere."""
from __future__ import annotations

import pytest
import torch

from sparsevar import InfinityPipeline, VARPipeline
from sparsevar.policies import ScaleKVPolicy


def test_offload_without_a_gpu_is_refused_in_one_line():
    pipe = VARPipeline.from_random("var-tiny")
    with pytest.raises(ValueError, match="enable_model_cpu_offload needs a CUDA GPU .*device='cpu'"):
        pipe.enable_model_cpu_offload(device="cpu")
    assert not pipe.model_cpu_offload


def test_sequential_offload_without_a_gpu_is_refused_in_one_line():
    pipe = InfinityPipeline.from_random("infinity-tiny")
    with pytest.raises(ValueError, match="enable_sequential_cpu_offload needs a CUDA GPU to stream to .*device='cpu'"):
        pipe.enable_sequential_cpu_offload(device="cpu")
    assert not pipe.sequential_cpu_offload and not pipe.text_encoder_streaming
    assert all(not p.is_pinned() for p in pipe.transformer.parameters())


def test_text_encoder_streaming_is_refused_without_a_gpu_or_a_text_encoder():
    with pytest.raises(ValueError, match=r"enable_text_encoder_streaming\(\): VARPipeline has no text encoder"):
        VARPipeline.from_random("var-tiny").enable_text_encoder_streaming()
    pipe = InfinityPipeline.from_random("infinity-tiny")
    with pytest.raises(ValueError, match="enable_text_encoder_streaming needs a CUDA GPU to stream to .*device='cpu'"):
        pipe.enable_text_encoder_streaming(device="cpu")
    assert not pipe.text_encoder_streaming
    assert all(p.device.type == "cpu" and not p.is_pinned() for p in pipe.text_encoder.parameters())


def _devices(pipe) -> dict:
    return {name: next(m.parameters()).device.type for name, m in pipe.components.items()
            if isinstance(m, torch.nn.Module)}


@pytest.mark.gpu
def test_infinity_components_visit_the_gpu_one_at_a_time_and_the_pictures_do_not_change():
    pipe = InfinityPipeline.from_random("infinity-tiny", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    seen = []

    def call():
        return pipe(["w3 w4 w5", "w9"], height=256, width=256, generator=torch.Generator("cuda").manual_seed(0),
                    output_type="pt", callback_on_step_end=lambda p, si, t, d: seen.append(_devices(p)) or d).images

    from sparsevar.sparse_ops._backend import resolve_backend
    assert pipe.kernels == ("triton" if resolve_backend("auto", "cuda") == "triton" else "torch")   # the default
    resident = call()
    pipe.enable_model_cpu_offload()
    assert _devices(pipe) == {"transformer": "cpu", "vae": "cpu", "text_encoder": "cpu"}
    first = call()                       # the weights come back at new addresses: graphs captured again
    call()
    ws = pipe.adapter()._workspace
    graphs, ptrs = dict(ws.graphs), ws.kv.storage_ptrs()
    buffer = pipe._model_offload.buffer.data_ptr()          # the components take turns in one buffer
    assert graphs
    seen.clear()
    second = call()
    # during the scale loop only the transformer is on the GPU; after the call nothing is
    assert seen and all(d == {"transformer": "cuda", "vae": "cpu", "text_encoder": "cpu"} for d in seen)
    assert _devices(pipe) == {"transformer": "cpu", "vae": "cpu", "text_encoder": "cpu"}
    assert torch.equal(first, resident) and torch.equal(second, resident)
    assert ws.graphs == graphs and ws.kv.storage_ptrs() == ptrs          # replayed, not captured again
    assert pipe._model_offload.buffer.data_ptr() == buffer
    with pytest.raises(ValueError, match="while model CPU offload is on"):
        pipe.to("cuda")
    assert pipe.set_kernels("triton").kernels in ("triton", "compile")     # chosen for the GPU it runs on
    pipe.set_kernels("auto").disable_model_cpu_offload().to("cuda")
    assert torch.equal(call(), resident)


@pytest.mark.gpu
def test_var_offload_keeps_the_tokenizer_for_the_loop_and_frees_the_gpu_after_the_call():
    """VAR's loop needs the VQVAE's quantizer (each scale's codes are accumulated through it), so
    both are on the GPU for the loop and the VQVAE alone for the decode; between calls the GPU holds
    the workspace only, and the peak is no higher than resident. Memory is counted from what the
    process held before the test (earlier tests in the same process may hold some)."""
    before = torch.cuda.memory_allocated()
    pipe = VARPipeline.from_random("var-d16", device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    seen = []

    def peak_call():
        pipe.release_memory()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        images = pipe([1, 2], generator=torch.Generator("cuda").manual_seed(0), output_type="pt",
                      callback_on_step_end=lambda p, si, t, d: seen.append(_devices(p)) or d).images
        return images, torch.cuda.max_memory_allocated()

    nbytes = {k: sum(t.nbytes for t in (*m.parameters(), *m.buffers())) for k, m in pipe.components.items()
              if isinstance(m, torch.nn.Module)}
    resident, resident_peak = peak_call()
    pipe.enable_model_cpu_offload()
    seen.clear()
    out, offload_peak = peak_call()
    assert torch.equal(out, resident) and offload_peak <= resident_peak
    assert seen and all(d == {"transformer": "cuda", "vqvae": "cuda"} for d in seen)
    assert _devices(pipe) == {"transformer": "cpu", "vqvae": "cpu"}
    pipe.release_memory()
    assert torch.cuda.memory_allocated() - before < min(nbytes.values())


def _infinity_with_t5_layers(layers: int):
    """infinity-tiny on the GPU with a random T5 of its width and ``layers`` blocks."""
    from sparsevar.models.text_encoder import random_t5
    base = InfinityPipeline.from_random("infinity-tiny", device="cuda", dtype=torch.bfloat16)
    tokenizer, t5 = random_t5(base.text_encoder.config.d_model, seed=1, num_layers=layers)
    pipe = InfinityPipeline(transformer=base.transformer, vae=base.vae, text_encoder=t5.to("cuda"), tokenizer=tokenizer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.gpu
def test_text_encoder_streaming_keeps_the_pictures_and_holds_two_blocks():
    from sparsevar.pipelines.offload import stream_bytes
    pipe = _infinity_with_t5_layers(6)
    t5 = pipe.text_encoder
    blocks = t5.encoder.block

    def call(**kw):
        return pipe(["w3 w4 w5", "w9 w10"], height=256, width=256, generator=torch.Generator("cuda").manual_seed(0),
                    output_type="pt", **kw).images

    resident, features = call(), pipe.encode_prompt("w3 w4 w5")
    pipe.enable_text_encoder_streaming()
    assert {p.device.type for p in blocks.parameters()} == {"cpu"} and all(p.is_pinned() for p in blocks.parameters())
    assert t5.shared.weight.device.type == "cuda"                                # the embeddings stay
    before = torch.cuda.memory_allocated()
    streamed = pipe.encode_prompt("w3 w4 w5")
    held = torch.cuda.memory_allocated() - before
    assert torch.equal(streamed.kv_compact_NC, features.kv_compact_NC) and streamed.lens == features.lens
    assert {p.device.type for p in blocks.parameters()} == {"cpu"}              # back after the forward
    # what stays allocated: the two slots (the embeddings were there before)
    slot = pipe._text_stream.slot_bytes
    assert 2 * slot - (2 << 20) <= held <= 2 * slot + (1 << 20)
    assert stream_bytes(t5) - 2 * slot == sum(t.nbytes for t in (*t5.parameters(), *t5.buffers())) - sum(
        t.nbytes for t in (*blocks.parameters(), *blocks.buffers()))
    assert torch.equal(call(), resident) and torch.equal(call(), resident)
    with pytest.raises(ValueError, match="while the text encoder streams"):
        pipe.to("cuda")
    with pytest.raises(ValueError, match=r"enable_model_cpu_offload\(\) while the text encoder streams"):
        pipe.enable_model_cpu_offload()
    est = pipe.estimate_memory(1, 256, 256)
    assert est.phases["prompt"]["text_encoder weights"] == stream_bytes(t5)
    pipe.disable_text_encoder_streaming().to("cuda")
    assert torch.equal(call(), resident)


@pytest.mark.gpu
def test_low_vram_places_a_pipeline_loaded_on_the_cpu_as_its_choice_needs():
    """A pipeline still in CPU memory goes to the GPU as enable_low_vram's choice needs: with room for
    all but the text encoder, all but the text encoder's blocks (streamed); with room for all, whole."""
    from sparsevar.models.text_encoder import random_t5
    base = InfinityPipeline.from_random("infinity-tiny", dtype=torch.bfloat16)
    tokenizer, t5 = random_t5(base.text_encoder.config.d_model, seed=1, num_layers=6)

    def fresh():
        pipe = InfinityPipeline(transformer=base.transformer, vae=base.vae, text_encoder=t5, tokenizer=tokenizer)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    pipe = fresh()
    dense = pipe.estimate_memory(1, 256, 256).reserved_bytes
    streamed = pipe.estimate_memory(1, 256, 256, text_encoder_streaming=True).reserved_bytes
    assert streamed < dense
    room = (streamed + dense) // 2                            # between the two
    assert pipe.enable_low_vram(1, 256, 256, available=room, device="cuda") == ["text encoder streaming"]
    assert pipe.transformer.device.type == "cuda" and pipe.text_encoder.shared.weight.device.type == "cuda"
    assert all(p.device.type == "cpu" for p in t5.encoder.block.parameters())
    images = pipe(["w3 w4"], height=256, width=256, generator=torch.Generator("cuda").manual_seed(0),
                  output_type="pt").images
    pipe.disable_text_encoder_streaming()
    whole = fresh()
    assert whole.enable_low_vram(1, 256, 256, device="cuda") == [] and whole.transformer.device.type == "cuda"
    assert torch.equal(whole(["w3 w4"], height=256, width=256, generator=torch.Generator("cuda").manual_seed(0),
                             output_type="pt").images, images)


def _linear_weights(pipe) -> list:
    return [m.weight for b in pipe.adapter().blocks for m in b.modules() if isinstance(m, torch.nn.Linear)]


def _family(name: str):
    """(a tiny pipeline of family ``name`` on the GPU in bf16, a seeded call of it)."""
    from sparsevar import FlexVARPipeline, HARTPipeline
    if name == "infinity":
        pipe = _infinity_with_t5_layers(3)
        args = dict(prompt=["w3 w4 w5", "w9 w10"], height=256, width=256)
    else:
        cls, args = {"var": (VARPipeline, dict(class_labels=[1, 7])),
                     "flexvar": (FlexVARPipeline, dict(class_labels=[3, 5])),
                     "hart": (HARTPipeline, dict(prompt=["w3 w4", "w5"]))}[name]
        pipe = cls.from_random(device="cuda", dtype=torch.bfloat16)
        pipe.set_progress_bar_config(disable=True)

    def call(**kw):
        return pipe(**args, generator=torch.Generator("cuda").manual_seed(0), output_type="pt", **kw).images
    return pipe, call


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["var", "flexvar", "infinity", "hart"])
def test_sequential_offload_keeps_the_pictures_and_holds_two_blocks(family):
    """The blocks' matrices live in pinned CPU memory and visit the GPU two at a time during the
    scale loop (and the text encoder's blocks during the prompt); the pictures are those of the
    pipeline kept on the GPU (replayed from CUDA graphs there, eager here)."""
    from sparsevar.pipelines.offload import ALIGN, SEGMENT
    pipe, call = _family(family)
    resident = call()
    matrices = _linear_weights(pipe)
    matrix_bytes = sum(w.nbytes for w in matrices)
    total = _weights(pipe.transformer)
    before = torch.cuda.memory_allocated()
    pipe.enable_sequential_cpu_offload()
    assert pipe.sequential_cpu_offload and pipe.text_encoder_streaming == (family in ("infinity", "hart"))
    assert all(w.device.type == "cpu" and w.is_pinned() for w in matrices)
    assert all(p.device.type == "cuda" for p in pipe.transformer.parameters() if all(p is not w for w in matrices))
    assert before - torch.cuda.memory_allocated() >= matrix_bytes          # (and the text encoder's blocks)
    first, second = call(), call()
    assert torch.equal(first, resident) and torch.equal(second, resident)
    assert all(w.device.type == "cpu" for w in matrices)                   # back after the call
    largest = max(sum(-(-m.weight.nbytes // ALIGN) * ALIGN for m in b.modules() if isinstance(m, torch.nn.Linear))
                  for b in pipe.adapter().blocks)
    slot = pipe._layer_stream.slot_bytes
    assert largest <= slot < largest + SEGMENT and pipe._layer_stream.slots.numel() == 2 * slot
    est = pipe.estimate_memory(2, **({"height": 256, "width": 256} if family == "infinity" else {}))
    assert est.phases["scale loop"]["transformer weights"] == total - matrix_bytes + 2 * slot
    with pytest.raises(ValueError, match="while sequential CPU offload is on"):
        pipe.to("cuda")
    with pytest.raises(ValueError, match=r"enable_model_cpu_offload\(\) while sequential CPU offload is on"):
        pipe.enable_model_cpu_offload()
    pipe.disable_sequential_cpu_offload()
    assert not pipe.text_encoder_streaming
    pipe.to("cuda")
    assert torch.equal(call(), resident)


@pytest.mark.gpu
@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_layer_stream_enters_each_group_with_its_own_values_pass_after_pass(count):
    """Groups of tensors entered in turn, several passes over an odd or even count (the last group and
    the first share a slot when the count is odd): each enter sees its own group's values, also
    with a long kernel queued before every read, and after a leave the tensors are the CPU copies."""
    from sparsevar.pipelines.offload import _SlotStream
    g = torch.Generator().manual_seed(0)
    groups = [[torch.randn(512, 256 + 64 * i, generator=g), torch.randn(1000 + i, generator=g)] for i in range(count)]
    expected = [sum(float(t.double().sum()) for t in grp) for grp in groups]
    stream = _SlotStream(groups, "cuda", cyclic=True)
    busy = torch.randn(2048, 2048, device="cuda")
    sums = []
    for _ in range(3):
        for i, grp in enumerate(groups):
            stream.enter(i)
            for _ in range(4):
                busy = busy @ busy / 50                                  # keeps the GPU behind the host
            sums.append(sum(t.double().sum() for t in grp))
            stream.leave(i)
            assert all(t.device.type == "cpu" for t in grp)
    got = [float(s) for s in sums]
    assert got == pytest.approx(expected * 3, rel=1e-9)
    stream.release()
    assert stream.slots is None


# ---- estimate_memory (pipelines/memory.py) ------------------------------------------------------------
def _weights(module) -> int:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def test_estimate_counts_the_weights_and_the_exact_kv_cache_and_grows_with_the_batch():
    pipe = VARPipeline.from_random("var-tiny")
    pipe.set_progress_bar_config(disable=True)
    for enable in (lambda: None, lambda: pipe.enable_scalekv(budget=0.3, min_tokens=0, window=4)):
        enable()
        est = pipe.estimate_memory(batch_size=2)
        pipe([1, 2], generator=torch.Generator().manual_seed(0), output_type="pt")
        loop = est.phases["scale loop"]
        assert loop["KV cache"] == pipe.adapter()._workspace.kv.nbytes()            # what the call allocated
        assert loop["transformer weights"] == _weights(pipe.transformer)
        assert loop["vqvae weights"] == _weights(pipe.vqvae)
        assert est.peak_bytes == max(sum(p.values()) for p in est.phases.values())
    one, four = pipe.estimate_memory(1), pipe.estimate_memory(4)
    assert four.peak_bytes > 2 * one.peak_bytes
    assert pipe.estimate_memory(1, policies=[]).phases["scale loop"]["KV cache"] > one.phases["scale loop"]["KV cache"]
    assert str(one).startswith("peak ") and one.peak_phase in str(one)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        pipe.estimate_memory(0)
    with pytest.raises(ValueError, match="draws 256x256 pictures only"):
        pipe.estimate_memory(1, height=512, width=512)


def test_infinity_estimate_frees_the_cache_for_the_decode_and_has_a_prompt_phase():
    pipe = InfinityPipeline.from_random("infinity-tiny")
    est = pipe.estimate_memory(1, height=256, width=256)
    assert set(est.phases) == {"prompt", "scale loop", "decode"}
    assert est.phases["decode"]["KV cache"] == 0 and est.phases["prompt"]["KV cache"] > 0
    assert est.phases["prompt"]["text_encoder weights"] == _weights(pipe.text_encoder)
    big = pipe.estimate_memory(1, height=1024, width=1024)
    assert big.peak_bytes > est.peak_bytes


def test_offloaded_estimate_holds_the_weight_buffer_of_the_largest_component_in_every_phase():
    pipe = InfinityPipeline.from_random("infinity-tiny")
    est = pipe.estimate_memory(1, height=256, width=256, model_cpu_offload=True)
    largest = max(_weights(pipe.transformer), _weights(pipe.text_encoder), _weights(pipe.vae))
    for phase in ("prompt", "scale loop", "decode"):
        assert [k for k in est.phases[phase] if k.endswith("weights")] == ["offloaded weights"]
        assert est.phases[phase]["offloaded weights"] == largest
    resident = pipe.estimate_memory(1, height=256, width=256)
    assert est.working_bytes == resident.working_bytes                       # the same work, fewer weights
    assert est.peak_bytes < resident.peak_bytes
    var = VARPipeline.from_random("var-tiny")                                 # its loop holds both components
    loop = var.estimate_memory(1, model_cpu_offload=True).phases["scale loop"]["offloaded weights"]
    assert loop == _weights(var.transformer) + _weights(var.vqvae)


def test_memory_options_name_the_settings_whose_estimate_fits():
    pipe = InfinityPipeline.from_random("infinity-tiny")
    skv = pipe.estimate_memory(1, 1024, 1024, policies=[ScaleKVPolicy(pipe.scalekv_preset)])
    assert skv.phases["scale loop"]["KV cache"] < pipe.estimate_memory(1, 1024, 1024).phases["scale loop"]["KV cache"]
    # on the CPU offload is no option; ScaleKV is, where its estimate fits
    got = pipe.memory_options(1, 1024, 1024, available=skv.peak_bytes)
    assert len(got) == 1 and got[0].startswith("pipe.enable_scalekv() / --scalekv (")
    assert pipe.memory_options(1, 1024, 1024, available=skv.peak_bytes - 1) == []
    pipe.enable_sparvar()
    assert pipe.memory_options(1, 1024, 1024, available=10 ** 15) == []          # SparVAR cannot take ScaleKV


def _infinity_2b_on_meta():
    """Infinity-2B at its real size with no memory behind it (estimates only)."""
    from accelerate import init_empty_weights

    from sparsevar.models.bsq_vae import BSQVAE
    from sparsevar.models.infinity import INFINITY_PRESETS, InfinityTransformer
    from sparsevar.models.text_encoder import random_t5
    spec = INFINITY_PRESETS["infinity-2b"]
    with init_empty_weights():
        transformer, vae = InfinityTransformer(**spec["transformer"]), BSQVAE(**spec["vae"])
    tokenizer, t5 = random_t5(2048)
    return InfinityPipeline(transformer=transformer.set_block_dtype(torch.bfloat16),
                            vae=torch.nn.Module.to(vae, torch.bfloat16), text_encoder=t5, tokenizer=tokenizer)


def test_sequential_estimate_holds_two_blocks_of_matrices():
    """Infinity-2B: each block's linear layers are 16·C² weights (qkv 3, proj 1, cross q 1, kv 2, proj 1,
    FFN 4 + 4), in bf16 268 MB for C = 2048; under sequential offload two of them (slot-rounded) stay."""
    pipe = _infinity_2b_on_meta()
    C, depth = 2048, 32
    block = 16 * C * C * 2
    dense = pipe.estimate_memory(1, 1024, 1024)
    seq = pipe.estimate_memory(1, 1024, 1024, sequential_cpu_offload=True)
    slot = -(-block // (2 << 20)) * (2 << 20)
    assert dense.phases["scale loop"]["transformer weights"] - seq.phases["scale loop"]["transformer weights"] == \
        depth * block - 2 * slot
    from sparsevar.pipelines.offload import stream_bytes
    assert seq.phases["prompt"]["text_encoder weights"] == stream_bytes(pipe.text_encoder)
    assert seq.peak_bytes < pipe.estimate_memory(1, 1024, 1024, text_encoder_streaming=True).peak_bytes - 3 * 10 ** 9
    with pytest.raises(ValueError, match="cannot be on together"):
        pipe.estimate_memory(1, 1024, 1024, sequential_cpu_offload=True, model_cpu_offload=True)


def test_low_vram_enables_what_the_estimate_needs_and_nothing_more():
    pipe = _infinity_2b_on_meta()
    dense = pipe.estimate_memory(1, 1024, 1024)
    # 2B bf16 weights 4.52 GB, KV cache 32 layers × 2 rows × 10521 tokens × (2 × 2048 × 2 B + 8 B) = 5.52 GB
    assert dense.phases["scale loop"]["transformer weights"] == pytest.approx(4.52e9, rel=0.01)
    assert dense.phases["scale loop"]["KV cache"] == 32 * 2 * 10521 * (2 * 2048 * 2 + 8)
    assert pipe.enable_low_vram(1, 1024, 1024, available=int(1.3 * dense.peak_bytes)) == []
    assert len(pipe.policies) == 0
    with pytest.raises(ValueError, match="none of text encoder streaming, model CPU offload, ScaleKV, sequential CPU offload or ScaleKV with any of them would fit"):
        pipe.enable_low_vram(1, 1024, 1024, available=4 * 10 ** 9)
    # the allocator's reserve: the loop's activations (2 rows × 4096 tokens × 2048 channels × 70 B) once more
    assert dense.reserved_bytes == dense.peak_bytes + 2 * 4096 * 2048 * 70
    assert pipe.enable_low_vram(1, 1024, 1024, available=dense.reserved_bytes) == []
    assert pipe.enable_low_vram(1, 1024, 1024, available=dense.reserved_bytes - 1) == ["ScaleKV"]
    assert [p.name for p in pipe.policies] == ["scalekv"]
    assert pipe.estimate_memory(1, 1024, 1024).phases["scale loop"]["KV cache"] < 10 ** 9     # 0.69 GB


def test_low_vram_rejects_a_bad_device_or_size_in_one_line():
    pipe = VARPipeline.from_random("var-tiny")
    with pytest.raises(ValueError, match=r"enable_low_vram\(device='gpu'\): not a device; pass 'cuda'"):
        pipe.enable_low_vram(device="gpu")
    with pytest.raises(ValueError, match=r"enable_low_vram\(available=-1\): give the bytes .* an int >= 0"):
        pipe.enable_low_vram(available=-1)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"enable_low_vram\(device='cuda'\) needs a CUDA GPU \(this machine "
                                             r"has no CUDA device\)"):
            pipe.enable_low_vram(device="cuda")
    assert pipe.enable_low_vram(device="cpu") == [] and len(pipe.policies) == 0


def test_cli_low_vram_says_what_it_enabled(tmp_path):
    import subprocess
    import sys
    out = tmp_path / "img.png"
    run = subprocess.run([sys.executable, "-m", "sparsevar", "generate", "--class", "1", "--low-vram", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "--low-vram: nothing needed (peak " in run.stderr and "in the scale loop" in run.stderr
    assert out.is_file()
