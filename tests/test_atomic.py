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


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_published_files_and_exports_follow_the_umask(tmp_path, mask):
    """Model files written by safetensors (its own 0600 temp renamed onto the path) and export
    directories get the modes a plain open()/mkdir gives under the user's umask."""
    import os

    import torch
    from safetensors.torch import save_file

    from moescale.atomic import new_directory

    old = os.umask(mask)
    try:
        with atomic_path(tmp_path / "ckpt.safetensors") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp))
        with new_directory(tmp_path / "export") as folder:
            save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
        plain = tmp_path / "plain"
        plain.write_text("x")
    finally:
        os.umask(old)
    want_file = 0o666 & ~mask
    assert (plain.stat().st_mode & 0o777) == want_file
    assert ((tmp_path / "ckpt.safetensors").stat().st_mode & 0o777) == want_file
    assert ((tmp_path / "export" / "model.safetensors").stat().st_mode & 0o777) == want_file
    assert ((tmp_path / "export").stat().st_mode & 0o777) == 0o777 & ~mask
