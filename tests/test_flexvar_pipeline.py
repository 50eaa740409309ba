"""FlexVARPipeline (issue #31): the official files (``FlexVAE.pth`` as ``{'model': sd}``, the
transformer flat or as a training checkpoint) through the project's loaders, the reference's greedy
picture at the default schedule, other schedules (13 steps, and a shorter one), policies, and bad input."""
from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path

import pytest
import torch
from accelerate import init_empty_weights
from safetensors.torch import load_file

from sparsevar import FlexVARPipeline

KEYS_DIR = Path(__file__).resolve().parent / "fixtures" / "flexvar" / "keys"


@pytest.fixture(scope="module")
def files(flexvar_official_files):
    return flexvar_official_files


@pytest.fixture(scope="module")
def pipe(files):
    p = FlexVARPipeline.from_single_file(files / "FlexVARd2.pth", files / "FlexVAE.pth")
    p.set_progress_bar_config(disable=True)
    return p


def _greedy_run(fixture_dir) -> dict:
    """The set's first greedy run (``config.json`` ``ar_runs``, top-k 1) that stores an image (``b0``), else its
    first greedy run."""
    runs = [r for r in json.loads((fixture_dir / "config.json").read_text())["ar_runs"] if r["top_k"] == 1]
    assert runs, f"{fixture_dir / 'config.json'} lists no greedy run (top_k 1)"
    return next((r for r in runs if "b0" in r["stored"]), runs[0])


def test_official_files_draw_the_references_greedy_picture(pipe, files, flexvar_fixture_dir):
    """A greedy run of the set through the pipeline (its labels, schedule, guidance, CFG mode and
    max_pn from ``config.json``): every scale's codes exact, the image within the README's 2e-4; the
    training-checkpoint container gives the same image bit for bit."""
    want = load_file(flexvar_fixture_dir / "flexvar_ar.safetensors")
    spec = _greedy_run(flexvar_fixture_dir)
    run, pn = spec["name"], spec["patch_nums"]
    kw = dict(patch_nums=pn, guidance_scale=spec["cfg"], top_k=1, top_p=0.0, llamagen_cfg=spec["used_llamagen_cfg"],
              max_pn=spec["max_pn"], output_type="pt")
    codes = []
    out = pipe(spec["labels"], generator=torch.Generator().manual_seed(spec["g_seed"]),
               callback_on_step_end=lambda p, si, t, d: codes.append(d["codes"]) or d, **kw)
    assert len(codes) == len(pn) and all(torch.equal(c, want[f"{run}.idx_s{k}"]) for k, c in enumerate(codes))
    if "b0" in spec["stored"]:                   # batch element 0, raw decoder output; ours is clamped to [0, 1]
        torch.testing.assert_close(out.images[:1] * 2 - 1, want[f"{run}.img"].clamp(-1, 1), rtol=0, atol=2e-4)
    trainer = FlexVARPipeline.from_single_file(files / "FlexVARd2-trainer.pth", files / "FlexVAE.pth")
    trainer.set_progress_bar_config(disable=True)
    again = trainer(spec["labels"], generator=torch.Generator().manual_seed(spec["g_seed"]), **kw)
    assert torch.equal(again.images, out.images)


def test_any_schedule_sets_the_size_and_policies_run(pipe):
    out = pipe(3, patch_nums=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16), generator=torch.Generator().manual_seed(0),
               output_type="pt")
    assert out.images.shape == (1, 3, 256, 256) and len(out.stats[0].scales) == 13
    small = pipe(3, patch_nums=(1, 2, 4, 8), generator=torch.Generator().manual_seed(0), output_type="pt")
    assert small.images.shape == (1, 3, 128, 128)
    dense = pipe([3, 7], generator=torch.Generator().manual_seed(1), output_type="pt")
    pipe.enable_fastvar(ratios=(0.5, 0.75))
    fast = pipe([3, 7], generator=torch.Generator().manual_seed(1), output_type="pt")
    pipe.disable_fastvar()
    assert sum(s.tokens_computed for s in fast.stats[0].scales) < sum(s.tokens_computed for s in dense.stats[0].scales)
    assert pipe.flop_speedup(fast.stats[0]) > 1.0


@pytest.mark.parametrize("kw, match", [
    (dict(class_labels=10), r"class label 10 is out of range: this model has classes 0..9"),
    (dict(class_labels=[]), r"class_labels=\[\]: give a class id 0..9 or a class name"),
    (dict(class_labels="dog"), r"class name 'dog' given, but this model has no class names"),
    (dict(class_labels=[1], patch_nums=(2, 4)), r"patch_nums=\(2, 4\): give increasing square sides starting at 1"),
    (dict(class_labels=[1], patch_nums=(1, 4, 4)), "give increasing square sides"),
    (dict(class_labels=[1], max_pn=0), r"max_pn=0: give the largest side .* an int >= 1"),
])
def test_bad_calls_name_the_argument(pipe, kw, match):
    with pytest.raises(ValueError, match=match):
        pipe(**kw)


def test_wrong_files_are_named(files):
    with pytest.raises(ValueError, match=r"is a FlexVAR transformer \(FlexVARd\*.pth\), not FlexVAR's tokenizer"):
        FlexVARPipeline.from_single_file(files / "FlexVARd2.pth", files / "FlexVARd2.pth")


def _key_file(name: str) -> tuple[dict, dict]:
    """An official key list (``key<TAB>(shape)<TAB>dtype<TAB>param|buffer`` rows, ``#`` header) as
    {key: ([shape], dtype)} and {key: kind}. Its header is checked against its rows (key count, and the
    parameter elements = the elements of the ``param`` rows), so a truncated or edited copy fails here
    rather than agreeing with a model that lost the same keys."""
    rows, kinds, header = {}, {}, None
    for line in (KEYS_DIR / name).read_text().splitlines():
        if line.startswith("#"):
            if m := re.fullmatch(r"# (\d+) keys, (\d+) parameter elements \(.*\)", line):
                header = int(m.group(1)), int(m.group(2))
            continue
        if line.strip():
            key, shape, dtype, kind = line.split("\t")
            rows[key], kinds[key] = (list(ast.literal_eval(shape)), dtype), kind
    assert header is not None and len(rows) == header[0] > 0, name
    assert sum(math.prod(s) for k, (s, _) in rows.items() if kinds[k] == "param") == header[1], name
    return rows, kinds


def _layout(module: torch.nn.Module) -> dict:
    return {k: (list(p.shape), str(p.dtype).removeprefix("torch.")) for k, p in module.state_dict().items()}


@pytest.mark.parametrize("model", ["d16", "d20", "d24", "vae"])
def test_official_key_lists_load_through_the_loaders_and_match_the_presets(model, tmp_path):
    """Each released file's keys and shapes (``fixtures/flexvar/keys/``, from the official constructors)
    written in the release's container (shapes only: meta tensors; the zero key biases real zeros) and
    read by ``load_flexvar_transformer`` / ``load_flexvar_vq``: the model they infer holds every official
    key with its shape and dtype except the derived buffers (``attn_bias_for_masking`` and one
    ``zero_k_bias`` per block; the tokenizer's ``quantize.codebook_used``), has the released sizes, and
    equals what the "flexvar-d*" preset builds."""
    from sparsevar.models.flexvar import FLEXVAR_PRESETS, FlexVARTransformer
    from sparsevar.models.flexvar_vq import FlexVQ16
    from sparsevar.models.loading import load_flexvar_transformer, load_flexvar_vq
    rows, kinds = _key_file(f"flexvar_{model}_keys.txt")
    sd = {k: torch.zeros(s) if k.endswith(".zero_k_bias") else torch.empty(s, device="meta")
          for k, (s, _) in rows.items()}
    if model == "vae":
        torch.save({"model": sd}, tmp_path / "FlexVAE.pth")
        loaded = load_flexvar_vq(tmp_path / "FlexVAE.pth")
        with init_empty_weights():
            preset = FlexVQ16(**FLEXVAR_PRESETS["flexvar-d16"]["vqvae"])
        derived = {"quantize.codebook_used"}
        assert (loaded.config.vocab_size, loaded.config.embed_dim, loaded.config.ch) == (8912, 32, 128)
    else:
        depth = int(model[1:])
        torch.save(sd, tmp_path / f"FlexVAR{model}.pth")
        loaded = load_flexvar_transformer(tmp_path / f"FlexVAR{model}.pth")
        with init_empty_weights():
            preset = FlexVARTransformer(**FLEXVAR_PRESETS[f"flexvar-{model}"]["transformer"])
        derived = {"attn_bias_for_masking"} | {f"blocks.{i}.attn.zero_k_bias" for i in range(depth)}
        c = loaded.config
        assert (c.depth, c.embed_dim, c.num_heads, c.vocab_size, c.num_classes, c.shared_aln) == \
            (depth, 64 * depth, depth, 8912, 1000, False)
    assert derived <= set(rows) and all(kinds[k] == "buffer" for k in derived)
    official = {k: v for k, v in rows.items() if k not in derived}
    assert _layout(loaded) == official
    assert _layout(preset) == official
    assert sum(p.numel() for p in loaded.parameters()) == \
        sum(math.prod(s) for k, (s, _) in rows.items() if kinds[k] == "param")


def test_a_nonzero_key_bias_is_refused(flexvar_state_dicts, tmp_path):
    """FlexVAR has no key bias (q and v biases only): a checkpoint whose ``zero_k_bias`` is not zero
    would generate otherwise than it claims, so the loader refuses it (as VAR's does) in one line that
    names the file, the key and why."""
    from sparsevar.models.loading import load_flexvar_transformer
    sd = dict(flexvar_state_dicts["flexvar"])
    key = next(k for k in sd if k.endswith(".zero_k_bias") and not k.startswith("blocks.0."))
    sd[key] = sd[key].clone()
    sd[key][3] = 0.5
    path = tmp_path / "FlexVARd2.pth"
    torch.save(sd, path)
    with pytest.raises(ValueError) as e:
        load_flexvar_transformer(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and key in msg
    assert re.search(rf"{re.escape(key)} must be zero \(FlexVAR's key bias is fixed at 0.* but 1 of its "
                     rf"{sd[key].numel()} values are not", msg), msg


def test_random_presets_build():
    p = FlexVARPipeline.from_random("flexvar-tiny", seed=0)
    p.set_progress_bar_config(disable=True)
    out = p([1, 2], generator=torch.Generator().manual_seed(0), output_type="pt")
    assert out.images.shape == (2, 3, 256, 256) and torch.isfinite(out.images).all()


@pytest.mark.parametrize("kw, want", [
    (dict(), (1, 2, 3, 4, 5, 6, 8, 10, 13, 16)),
    (dict(num_scales=13), (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16)),
    (dict(height=256, width=256, num_scales=9), (1, 2, 3, 4, 5, 7, 10, 13, 16)),
    (dict(height=512), (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16, 23, 32)),
    (dict(width=384), (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16, 20, 24)),
    (dict(height=128, width=128), (1, 2, 3, 4, 5, 6, 8)),
    (dict(height=256, num_scales=5), (1, 2, 4, 8, 16)),
    (dict(patch_nums=(1, 3, 7), height=112), (1, 3, 7)),
])
def test_size_and_steps_derive_the_references_schedules(kw, want):
    """The reference's schedules (README / eval script) where it has one; sizes in between by the rule."""
    assert FlexVARPipeline.resolve_schedule(**kw) == want


@pytest.mark.parametrize("kw, match", [
    (dict(height=250), r"height=250: FlexVAR draws pictures whose sides are multiples of 16 px"),
    (dict(height=256, width=512), r"height=256, width=512: the released FlexVAR models draw square pictures"),
    (dict(height=128, num_scales=12), r"num_scales=12: a schedule ending at side 8 \(128 px\) takes 2 to 8 steps"),
    (dict(patch_nums=(1, 2, 4), height=256), r"height=256 disagrees with patch_nums=\(1, 2, 4\)"),
    (dict(patch_nums=(1, 2, 4), num_scales=4), r"num_scales=4 disagrees"),
])
def test_impossible_sizes_and_steps_are_refused_with_the_choices(kw, match):
    with pytest.raises(ValueError, match=match):
        FlexVARPipeline.resolve_schedule(**kw)


def test_height_and_steps_reach_the_picture(pipe):
    out = pipe(3, height=128, num_scales=4, generator=torch.Generator().manual_seed(0), output_type="pt")
    assert out.images.shape == (1, 3, 128, 128)
    assert [s.h for s in out.stats[0].scales] == [1, 2, 4, 8]


def test_converted_folder_round_trips_and_a_mismatched_one_is_refused(pipe, tmp_path):
    folder = tmp_path / "flexvar"
    pipe.save_pretrained(folder)
    again = FlexVARPipeline.from_pretrained(folder)
    again.set_progress_bar_config(disable=True)
    a = pipe(3, height=128, generator=torch.Generator().manual_seed(0), output_type="pt").images
    b = again(3, height=128, generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert torch.equal(a, b)
    import shutil

    from sparsevar.models.flexvar_vq import FlexVQ16
    shutil.rmtree(folder / "vqvae")                          # another model's tokenizer, whole and consistent
    FlexVQ16(vocab_size=64, ch=32).save_pretrained(folder / "vqvae")
    with pytest.raises(ValueError, match=r"the transformer and the VQ-16 do not match: transformer/config.json has "
                                         r"vocab_size = 96, vqvae/config.json vocab_size = 64"):
        FlexVARPipeline.from_pretrained(folder)
