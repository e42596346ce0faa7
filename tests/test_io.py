"""tomlens.io: atomic writers leave the old file (or nothing) when a write fails; hashes are stable."""

from __future__ import annotations

import hashlib
import json
import math

import pandas as pd
import pytest

from tomlens.io import (
    atomic_path,
    file_sha256,
    json_key,
    read_json,
    read_table,
    records_hash,
    sha256_hex,
    write_atomic,
    write_json,
    write_jsonl,
    write_table,
)

pytestmark = pytest.mark.unit


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "deep" / "out.json"
    write_json({"a": 1}, target)
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("killed")
    assert read_json(target) == {"a": 1}
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.json"]


def test_write_json_makes_plain_values(tmp_path):
    import torch

    path = write_json({1: (1, 2), "nan": math.nan, "t": torch.tensor(2.5), "p": tmp_path}, tmp_path / "x.json")
    assert read_json(path) == {"1": [1, 2], "nan": None, "t": 2.5, "p": str(tmp_path)}
    assert path.read_text(encoding="utf-8").endswith("}\n")


def test_text_bytes_jsonl_and_tables_round_trip(tmp_path):
    assert write_atomic("é\n", tmp_path / "t.txt").read_text(encoding="utf-8") == "é\n"
    assert write_atomic(b"\x00\x01", tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    rows = [{"id": "a", "x": 1}, {"id": "b", "x": 2}]
    lines = write_jsonl(rows, tmp_path / "r.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == rows
    df = pd.DataFrame({"layer": [0, 1], "acc": [0.5, 0.75]})
    for name in ("t.csv", "t.parquet"):
        pd.testing.assert_frame_equal(read_table(write_table(df, tmp_path / name)), df)
    assert not list(tmp_path.glob("*.tmp"))


def test_hashes_are_the_sha256_they_promise(tmp_path):
    assert sha256_hex("abc") == hashlib.sha256(b"abc").hexdigest()
    assert sha256_hex(b"abc", 8) == hashlib.sha256(b"abc").hexdigest()[:8]
    assert json_key({"b": 1, "a": [1, 2]}) == json_key({"a": [1, 2], "b": 1}) != json_key({"a": [2, 1], "b": 1})
    assert len(json_key({}, 20)) == 20
    assert records_hash([{"a": 1}, {"b": 2}]) != records_hash([{"b": 2}, {"a": 1}])
    assert records_hash([{"a": 1, "b": 2}]) == hashlib.sha256(b'{"a": 1, "b": 2}\n').hexdigest()[:16]
    data = bytes(range(256)) * 10000
    assert file_sha256(write_atomic(data, tmp_path / "blob")) == hashlib.sha256(data).hexdigest()
