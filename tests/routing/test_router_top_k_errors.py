"""A router kind with a fixed top_k (switch: 1, gshard: 2) given another top_k names the fix
that keeps the router: the top_k to set (and its `moescale train` option), or the 'topk'
router to keep the top_k. `moescale train --model.router switch` with the default top_k 2 is
the case users hit."""

from __future__ import annotations

import pytest

from moescale.cli import main
from moescale.routing.config import RouterConfig


@pytest.mark.parametrize("kind, top_k, fix", [("switch", 2, "--model.top_k 1"),
                                              ("switch", 3, "--model.top_k 1"),
                                              ("gshard", 1, "--model.top_k 2")])
def test_fixed_top_k_routers_name_the_top_k_to_set(kind, top_k, fix):
    with pytest.raises(ValueError) as err:
        RouterConfig(kind=kind, num_experts=8, top_k=top_k)
    text = str(err.value)
    assert fix in text and f"top_k={top_k}" in text and "'topk'" in text


def test_moescale_train_switch_router_with_the_default_top_k(tmp_path, capsys):
    code = main(["train", "--model.router", "switch", "--train.steps", "1",
                 "--train.run_dir", str(tmp_path / "run"), "--train.progress", "false"])
    err = capsys.readouterr().err
    assert code == 2 and "--model.top_k 1" in err and "Traceback" not in err
    assert err.count("\n") == 1
