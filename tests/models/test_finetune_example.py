"""examples/finetune_hf_moe.py end to end on a small text file: a converted HF MoE model trains
with offloaded experts (host, then disk tier) and its saved checkpoint loads with
from_pretrained (the script itself compares the reloaded logits)."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "finetune_hf_moe.py"


def load_example():
    spec = importlib.util.spec_from_file_location("finetune_hf_moe", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_finetune_offloaded_then_resume_from_saved_checkpoint(tmp_path):
    example = load_example()
    text = tmp_path / "corpus.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 200)
    first, second = tmp_path / "first", tmp_path / "second"
    common = ["--data", str(text), "--batch", "4", "--seq", "32"]
    assert example.main(["--out", str(first), "--steps", "4", "--lr", "1e-2"] + common) == 0
    summary = json.loads((first / "finetune.json").read_text())
    assert summary["family"] == "qwen2_moe"
    assert summary["losses"][-1] < summary["losses"][0]
    assert summary["reload_max_abs_diff"] < 1e-4
    assert example.main(["--out", str(second), "--init", str(first), "--steps", "2",
                         "--tier", "disk"] + common) == 0
    resumed = json.loads((second / "finetune.json").read_text())
    assert resumed["losses"][0] < summary["losses"][0]   # started from the trained weights
