"""Atomic writes: a failure inside the block leaves the previous file whole and no temp files."""

import pytest

from moescale.atomic import atomic_path, atomic_write_json, atomic_write_text


def test_success_replaces_the_file_and_leaves_no_temporaries(tmp_path):
    target = tmp_path / "sub" / "state.txt"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert sorted(p.name for p in target.parent.iterdir()) == ["state.txt"]


def test_a_crash_mid_write_keeps_the_previous_file(tmp_path):
    target = tmp_path / "ckpt.json"
    atomic_write_json(target, {"step": 1})
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text('{"step": 2, "trunc')
            raise RuntimeError("simulated crash")
    assert target.read_text() == '{\n "step": 1\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.json"]
