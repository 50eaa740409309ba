"""The cuBLAS row padding (``sparse_ops/gemm_rows.py``): spare-row buffers, the padded product, the
shipped tables and the sweep's choice of padded counts. CPU: the padded product is the same
torch call on more rows, so the rules hold on any device."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from sparsevar.benchmarks.bench_gemm_rows import padding_table, table_json
from sparsevar.sparse_ops.kernels import Kernels
from sparsevar.sparse_ops.gemm_rows import (DIR_ENV, ROW_SLACK, TABLE_DIR, GemmRowTable, empty_rows, file_name,
                                            linear_rows, padded_rows, shape_key, spare_rows, table_dirs,
                                            user_table_dir)


def _rand_rows(shape, seed=0, row_dims=1):
    x = empty_rows(shape, dtype=torch.float32, device="cpu", row_dims=row_dims)
    return x.copy_(torch.randn(shape, generator=torch.Generator().manual_seed(seed)))


def test_empty_rows_leaves_spare_rows_after_the_tensor():
    x = empty_rows((3, 5, 8), dtype=torch.bfloat16, device="cpu")
    assert x.shape == (3, 5, 8) and x.is_contiguous() and x.dtype == torch.bfloat16
    assert spare_rows(x) == ROW_SLACK
    a = empty_rows((2, 3, 4, 16), dtype=torch.float32, device="cpu", row_dims=2)   # rows of H·d = 64
    assert a.shape == (2, 3, 4, 16) and spare_rows(a.view(2, 3, 64)) == ROW_SLACK
    assert spare_rows(torch.empty(7, 8)) == 0                                       # a plain tensor has none
    assert spare_rows(x[:, :4]) == 0                                                # not contiguous: no spare rows
    assert spare_rows(x[:2]) == ROW_SLACK + 5                                       # a leading slice: the rest is spare


@pytest.mark.parametrize("bias,gelu", [(True, False), (False, False), (True, True)])
def test_linear_rows_is_the_product_and_padding_keeps_every_real_row(bias, gelu):
    x = _rand_rows((2, 13, 24))                                                     # M = 26 rows
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    bias_ = b if bias else None
    want = F.linear(x, w, bias_)
    want = F.gelu(want, approximate="tanh") if gelu else want
    got = linear_rows(x, w, bias_, gelu)
    assert got.shape == (2, 13, 40) and spare_rows(got) == ROW_SLACK
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # spare rows full of NaN reach only spare output rows
    x.as_strided((26 + ROW_SLACK, 24), (24, 1)).narrow(0, 26, ROW_SLACK).fill_(float("nan"))
    for rows in (26 + 8, 26 + ROW_SLACK):
        padded = linear_rows(x, w, bias_, gelu, rows=rows)
        assert padded.shape == (2, 13, 40) and torch.isfinite(padded).all()
        torch.testing.assert_close(padded, want, rtol=1e-5, atol=1e-5)
        assert spare_rows(padded) >= ROW_SLACK                                      # the chain can pad again


def test_linear_rows_errors_name_the_fix():
    x = _rand_rows((10, 8))
    w, b = torch.randn(4, 8), torch.randn(4)
    with pytest.raises(ValueError, match="fewer than the input's 10 rows"):
        linear_rows(x, w, b, rows=9)
    with pytest.raises(ValueError, match="empty_rows"):
        linear_rows(torch.randn(10, 8), w, b, rows=12)                              # no spare rows
    with pytest.raises(ValueError, match="needs a bias"):
        linear_rows(x, w, None, gelu=True)


def test_table_rows_exact_rounded_and_unlisted():
    t = GemmRowTable({shape_key(40, 24, "bias"): {800: 808, 96: 104}}, source="test")
    assert t.covers(40, 24, "bias") and not t.covers(40, 24, "gelu") and len(t) == 2
    assert t.covers(40, 24, "bias", torch.bfloat16) and not t.covers(40, 24, "bias", torch.float16)
    assert t.rows(800, 40, 24, "bias") == 808
    assert t.rows(795, 40, 24, "bias") == 808                                       # up to the sweep's step of 8
    assert t.rows(801, 40, 24, "bias") == 801                                       # 808 itself is not listed
    assert t.rows(808, 40, 24, "bias") == 808 and t.rows(800, 40, 24, "gelu") == 800
    with pytest.raises(ValueError, match=f"by 0–{ROW_SLACK} rows"):
        GemmRowTable({shape_key(40, 24, "bias"): {100: 100 + ROW_SLACK + 8}}, source="bad")
    with pytest.raises(ValueError, match="epilogue='relu'"):
        shape_key(40, 24, "relu")


def test_padded_rows_needs_the_spare_rows_and_a_measured_shape():
    t = GemmRowTable({shape_key(40, 24, "bias"): {96: 104}}, dtype="float32")
    x = _rand_rows((96, 24))
    assert padded_rows(t, x, 40, "bias") == 104
    assert padded_rows(t, torch.randn(96, 24), 40, "bias") == 96                    # no spare rows: unpadded
    assert padded_rows(t, x, 40, "gelu") == 96 and padded_rows(None, x, 40, "bias") == 96
    x16 = empty_rows((96, 24), dtype=torch.bfloat16, device="cpu")                 # spare rows, another dtype:
    assert spare_rows(x16) == ROW_SLACK and padded_rows(t, x16, 40, "bias") == 96     # not measured, not padded


def test_table_files_load_and_keep_their_promises(tmp_path):
    files = sorted(TABLE_DIR.glob("*.json"))
    assert files, f"no shipped table in {TABLE_DIR}"
    for path in files:
        data = json.loads(path.read_text())
        assert path.name == file_name(data["device"], data["cuda"]), path
        t = GemmRowTable.load(path)
        assert len(t) > 0 and data["slack"] == ROW_SLACK
        for key, table in t.entries.items():
            N, rest = key.split("x")
            K, epilogue = rest.split(":")
            assert shape_key(int(N), int(K), epilogue) == key
            for m, mp in table.items():
                assert m < mp <= m + ROW_SLACK and m % data["step"] == 0 and mp % data["step"] == 0, (key, m, mp)
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="sparsevar bench gemm-rows"):
        GemmRowTable.load(bad)
    assert GemmRowTable.for_device("cpu") is None


def test_sweep_pads_to_the_smallest_count_near_the_fastest():
    times = {800: 57.5, 808: 35.0, 816: 34.8, 824: 35.1, 832: 50.0, 896: 36.0}
    table = padding_table(times, min_gain=0.05)
    assert table[800] == 808                      # 35.0 is within 3 % of 34.8: fewer wasted rows
    assert table[832] == 896 and 808 not in table and 816 not in table
    assert padding_table({8: 10.0, 16: 9.8}, min_gain=0.05) == {}                   # 2 % is noise, not a cliff
    data = dict(device="GPU", cuda="1.0", slack=ROW_SLACK, step=8, shapes={"4x2:bias": [[8, 16]]})
    assert json.loads(table_json(data)) == data


def test_row_table_only_under_fused_cuda_ops():
    assert Kernels("torch").row_table(torch.device("cpu")) is None
    assert Kernels("triton").row_table(torch.device("cpu")) is None
    assert Kernels("triton", row_padding=False).row_table(torch.device("cuda", 0)) is None


def test_tables_are_found_in_the_users_folder_before_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    assert user_table_dir() == tmp_path and table_dirs() == [tmp_path, TABLE_DIR]
    assert GemmRowTable.find("Some GPU", "12.8") is None
    data = dict(device="Some GPU", cuda="12.8", slack=ROW_SLACK, step=8, shapes={"40x24:bias": [[96, 104]]})
    (tmp_path / file_name("Some GPU", "12.8")).write_text(table_json(data))
    t = GemmRowTable.find("Some GPU", "12.8")
    assert t is not None and t.rows(96, 40, 24, "bias") == 104 and t.source.startswith(str(tmp_path))
    shipped = sorted(TABLE_DIR.glob("*.json"))[0]                   # none of the user's: the shipped one
    d = json.loads(shipped.read_text())
    assert GemmRowTable.find(d["device"], d["cuda"]).source == str(shipped)
    key = next(iter(d["shapes"]))                                    # the user re-swept one shipped shape
    mine = dict(d, shapes={key: [], "40x24:bias": [[96, 104]]})
    (tmp_path / shipped.name).write_text(table_json(mine))
    merged = GemmRowTable.find(d["device"], d["cuda"])
    assert merged.source == f"{tmp_path / shipped.name} + {shipped}"
    assert merged.entries[key] == {} and merged.entries["40x24:bias"] == {96: 104}     # the user's shapes win
    other = next(k for k in d["shapes"] if k != key)
    assert merged.entries[other] == {m: mp for m, mp in d["shapes"][other]}           # the rest: shipped
    monkeypatch.delenv(DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert user_table_dir() == tmp_path / "cache" / "sparsevar" / "gemm_rows"
    monkeypatch.delenv("XDG_CACHE_HOME")

    def no_home():
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.setattr("pathlib.Path.home", staticmethod(no_home))
    assert table_dirs() == [TABLE_DIR]                              # no home folder: the shipped tables only
