"""HARTPipeline (issue #29): the official folder layout (llm/ with ema_model.bin, tokenizer/ with the
discriminator beside the VQVAE) through the project's loaders, a real transformers Qwen2 text
encoder from a local folder, generation with the reference's defaults, determinism, batches,
policies, and bad input."""
from __future__ import annotations

import json

import pytest
import torch

from sparsevar import HARTPipeline
from sparsevar.models.hart_text import HART_SYSTEM_PROMPT, encode_hart_prompts, random_qwen2


@pytest.fixture(scope="module")
def official(hart_official_files):
    return hart_official_files


@pytest.fixture(scope="module")
def pipe(official):
    p = HARTPipeline.from_single_file(official["llm"], official["tokenizer"], official["text_encoder"])
    p.set_progress_bar_config(disable=True)
    return p


def test_prompts_are_encoded_after_the_system_prompt_and_padded_to_the_text_slots():
    tokenizer, model = random_qwen2(32, seed=0, vocab_words=HART_SYSTEM_PROMPT.split())
    ctx, mask, pos = encode_hart_prompts(tokenizer, model, ["w5 w6 w7", "w9"], max_length=12)
    assert ctx.shape == (2, 12, 32) and ctx.dtype == torch.float32
    assert mask.tolist()[1] == [True] + [False] * 11
    assert pos.tolist()[0] == [0, 1, 2] + [2] * 9                                   # pads repeat the last position
    sys_ids = tokenizer(HART_SYSTEM_PROMPT, return_tensors="pt", max_length=12, truncation=True).input_ids  # as the
    assert sys_ids.shape[1] == 12 and (sys_ids != tokenizer.unk_token_id).all()       # reference: cut at max_length
    ids = tokenizer("w5 w6 w7", return_tensors="pt", padding="max_length", max_length=12).input_ids
    full = model(torch.cat((sys_ids, ids), 1), attention_mask=torch.cat((torch.ones_like(sys_ids), ids != 0), 1).long(),
                 output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(ctx[0], full[0, sys_ids.shape[1]:])               # the prompt slots of that run


def test_official_folders_generate_deterministic_pictures_and_a_batch_equals_its_images(pipe):
    S, T = pipe.adapter().schedule.num_scales, pipe.transformer.config.context_token
    side = pipe.transformer.config.patch_nums[-1] * pipe.vqvae.downsample_factor
    gens = [torch.Generator().manual_seed(s) for s in (3, 4)]
    codes_both, codes_one = [], []
    both = pipe(["w5 w6 w7", "w9 w10"], generator=gens, output_type="pt",
                callback_on_step_end=lambda p, si, t, d: codes_both.append(d["codes"]) or d)
    assert both.images.shape == (2, 3, side, side) and torch.isfinite(both.images).all()
    assert len(both.stats[0].scales) == S and both.stats[0].scales[0].tokens_computed == T     # the text slots
    again = pipe(["w5 w6 w7", "w9 w10"], generator=[torch.Generator().manual_seed(s) for s in (3, 4)],
                 output_type="pt")
    assert torch.equal(again.images, both.images)
    one = pipe(["w9 w10"], generator=torch.Generator().manual_seed(4), output_type="pt",
               callback_on_step_end=lambda p, si, t, d: codes_one.append(d["codes"]) or d)
    assert len(codes_one) == S and all(torch.equal(a[1:], b) for a, b in zip(codes_both, codes_one))
    # the same codes; the pictures agree to float rounding, which the Gumbel mixture amplifies by about 1/τ
    torch.testing.assert_close(both.images[1:], one.images, rtol=0, atol=1e-3)
    other = pipe(["w5 w6 w7"], generator=torch.Generator().manual_seed(5), output_type="pt")
    assert (other.images - both.images[:1]).abs().max() > 1e-3
    sharp = pipe(["w5 w6 w7"], generator=torch.Generator().manual_seed(3), output_type="pt", smooth=False)
    assert (sharp.images - both.images[:1]).abs().max() > 1e-4                         # smooth changes the picture


def test_policies_run_on_the_pipeline(pipe):
    dense = pipe("w5 w6", generator=torch.Generator().manual_seed(0), output_type="pt")
    pipe.enable_fastvar()
    fast = pipe("w5 w6", generator=torch.Generator().manual_seed(0), output_type="pt")
    pipe.disable_fastvar()
    assert sum(s.tokens_computed for s in fast.stats[0].scales) < sum(s.tokens_computed for s in dense.stats[0].scales)
    pipe.enable_scale_skip(skip_last=1)
    skipped = pipe("w5 w6", generator=torch.Generator().manual_seed(0), output_type="pt")
    pipe.disable_scale_skip()
    assert skipped.stats[0].scales[-1].skipped


def test_prompt_features_from_encode_prompt_draw_the_same_pictures(pipe):
    """Encode once, generate many times (what a ComfyUI text-encode node needs): encode_prompt's
    features in place of the strings give the same picture; features of another model's shape, or
    both inputs, are refused naming the argument."""
    features = pipe.encode_prompt(["w5 w6 w7", "w9 w10"])
    a = pipe(["w5 w6 w7", "w9 w10"], generator=torch.Generator().manual_seed(3), output_type="pt",
             num_images_per_prompt=2).images
    b = pipe(prompt_features=features, generator=torch.Generator().manual_seed(3), output_type="pt",
             num_images_per_prompt=2).images
    assert torch.equal(a, b)
    context, mask, pos = features
    T, D = pipe.transformer.config.context_token, pipe.transformer.config.context_dim
    for bad in ((context[:, :-1], mask[:, :-1], pos[:, :-1]), (context[..., :-1], mask, pos), (context, mask.long(), pos),
                (context, mask), context):
        with pytest.raises(ValueError, match=rf"prompt_features must be what encode_prompt returns .*\(B, {T}, {D}\)"):
            pipe(prompt_features=bad)
    with pytest.raises(ValueError, match="either prompt or prompt_features"):
        pipe("w5", prompt_features=features)


@pytest.mark.parametrize("kw, match", [
    (dict(prompt=None), "prompt is required"),
    (dict(prompt=["a", 3]), "prompt must be a string or a non-empty list"),
    (dict(prompt="a", smooth="yes"), "smooth must be True or False"),
    (dict(prompt="a", guidance_scale=-1), "guidance_scale must be a number in"),
])
def test_bad_calls_name_the_argument(pipe, kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        pipe(**kw)


def test_missing_or_wrong_folders_say_what_to_put_where(official, tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json; pass the llm/ folder"):
        HARTPipeline.from_single_file(tmp_path, official["tokenizer"], official["text_encoder"])
    empty = tmp_path / "llm"
    empty.mkdir()
    (empty / "config.json").write_text((official["llm"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="holds none of ema_model.bin, model.safetensors"):
        HARTPipeline.from_single_file(empty, official["tokenizer"], official["text_encoder"])
    with pytest.raises(FileNotFoundError, match="put the Qwen2 text encoder HART was trained with"):
        HARTPipeline.from_single_file(official["llm"], official["tokenizer"], tmp_path / "nothing")


def test_random_presets_build():
    p = HARTPipeline.from_random("hart-tiny", seed=0)
    p.set_progress_bar_config(disable=True)
    out = p("w3 w4", generator=torch.Generator().manual_seed(0), output_type="pt")
    assert out.images.shape == (1, 3, 32, 32) and torch.isfinite(out.images).all()
    with pytest.raises(ValueError, match="preset='hart-9b' is unknown"):
        HARTPipeline.from_random("hart-9b")


def test_cli_generates_from_the_release_folder(official, tmp_path, capsys):
    """`sparsevar generate --prompt … --model <release folder or its llm/> --text-encoder <Qwen2>`;
    HART's own limits are refused by name before anything loads."""
    from sparsevar.cli import main
    release = official["llm"].parent
    out = tmp_path / "hart.png"
    assert main(["generate", "--prompt", "w5 w6", "--model", str(release), "--text-encoder",
                 str(official["text_encoder"]), "--out", str(out), "--fastvar", "--quiet"]) == 0
    assert out.is_file() and "1 image(s)" in capsys.readouterr().out
    assert main(["generate", "--prompt", "w5", "--model", str(official["llm"]), "--text-encoder",
                 str(official["text_encoder"]), "--out", str(tmp_path / "b.png"), "--quiet"]) == 0
    for extra, message in ((["--height", "512"], "--height 512: HART generates 1024×1024 only"),
                           (["--negative-prompt", "x"], "--negative-prompt: not for HART"),
                           ([], "also pass --text-encoder FOLDER")):
        te = [] if not extra else ["--text-encoder", str(official["text_encoder"])]
        assert main(["generate", "--prompt", "w5", "--model", str(release), *te, *extra,
                     "--out", str(tmp_path / "c.png"), "--quiet"]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "c.png").exists()


def test_convert_save_and_load_a_pipeline_folder_give_the_same_pictures(official, pipe, tmp_path, capsys):
    """`sparsevar convert` of the release folders (Qwen2 included) → HARTPipeline.from_pretrained and
    `generate --model FOLDER`; `sparsevar info` names the family of both."""
    from sparsevar.cli import main
    out = tmp_path / "hart-converted"
    assert main(["convert", "--ckpt", str(official["llm"].parent), "--text-encoder", str(official["text_encoder"]),
                 "--out", str(out)]) == 0
    loaded = HARTPipeline.from_pretrained(out)
    loaded.set_progress_bar_config(disable=True)
    a = pipe("w5 w6", generator=torch.Generator().manual_seed(2), output_type="pt").images
    b = loaded("w5 w6", generator=torch.Generator().manual_seed(2), output_type="pt").images
    assert torch.equal(a, b)
    capsys.readouterr()
    assert main(["generate", "--prompt", "w5", "--model", str(out), "--out", str(tmp_path / "x.png"), "--quiet"]) == 0
    assert "1 image(s)" in capsys.readouterr().out
    for path in (out, official["llm"].parent):
        assert main(["info", str(path), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["family"] == "hart"
    assert main(["generate", "--prompt", "w5", "--model", str(out), "--text-encoder", str(official["text_encoder"]),
                 "--out", str(tmp_path / "y.png"), "--quiet"]) == 2
    assert "is a converted HART folder with its text encoder inside" in capsys.readouterr().err


def test_the_last_scales_shared_kv_tail_changes_nothing_and_is_counted(pipe):
    """HART gives its last scale's K/V one tail shared by the layers where that makes the cache
    smaller (the whole per-layer cache is the other layout): the same codes and picture either way,
    and the memory check counts the cache that is built. The tail holds one layer's whole cache, so
    it pays only past a depth: here (2 layers) it does not, at the release size (24) it does."""
    adapter = pipe.adapter()
    sch, depth = adapter.schedule, pipe.transformer.config.depth
    smaller = sch.total_tokens < depth * sch.tokens(sch.num_scales - 1)
    assert adapter.kv_tail == smaller
    runs = {}
    try:
        for tail in (True, False):
            adapter.kv_tail = tail
            codes = []
            out = pipe(["w5 w6 w7"], generator=torch.Generator().manual_seed(3), output_type="pt",
                       callback_on_step_end=lambda p, si, t, d: codes.append(d["codes"]) or d)
            kv = adapter._workspace.kv
            last = adapter.schedule.tokens(adapter.schedule.num_scales - 1)
            assert kv.transient == (last if tail else 0)
            assert pipe.memory_needed(1)["KV cache"] == kv.nbytes()
            runs[tail] = (codes, out.images, kv.nbytes())
    finally:
        adapter.kv_tail = smaller
    (codes_t, img_t, bytes_t), (codes_f, img_f, bytes_f) = runs[True], runs[False]
    assert all(torch.equal(a, b) for a, b in zip(codes_t, codes_f)) and torch.equal(img_t, img_f)
    assert (bytes_t < bytes_f) == smaller
    big = HARTPipeline.from_random("hart-0.7b", device="meta", dtype="bfloat16").adapter()   # release size, no weights
    assert big.kv_tail
    tail_bytes = big.kv_cache_bytes(1, big.schedule)
    big.kv_tail = False
    assert tail_bytes < 0.65 * big.kv_cache_bytes(1, big.schedule)             # 1.79 against 2.88 GB
