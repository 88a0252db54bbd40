"""The codec's one-pass C loops (offload/codec_kernels.py) give bitwise the records of its torch
ops: int8 moments over twelve decades with zero blocks, a negative-absmax block and a partial
last block, and a bf16 master's stochastic rounding, through the whole-row methods and through
an AdamW step driven by `chunks` (several chunks). Skipped where no C compiler builds them."""

import pytest
import torch
from torch.optim.adamw import adamw

from moescale.offload import codec_kernels
from moescale.offload.compact_adamw import step_compact, step_reference
from moescale.offload.records import POS_EXP_AVG, POS_EXP_AVG_SQ, POS_MASTER
from moescale.offload.state_format import NOISE_NUMBERS, RecordGeometry, StateCodec, StateFormat
from test_state_format import awkward

pytestmark = pytest.mark.skipif(codec_kernels.load() is None,
                                reason="no C compiler builds the codec's loops here")
FORMATS = [StateFormat(master="bf16", moments="int8", seed=7),
           StateFormat(master="fp32", moments="int8"),
           StateFormat(master="bf16", moments="bf16", seed=3)]


def run(fmt: StateFormat, kernels: bool | None, numel: int) -> list[torch.Tensor]:
    """Encode awkward state, step it twice through `chunks` (512-number chunks), decode it:
    the record's bytes after each stage."""
    geo = RecordGeometry(fmt, numel)
    record = torch.zeros(geo.total, dtype=torch.uint8)
    codec = StateCodec(fmt, chunk=512, kernels=kernels)
    assert (codec.kernels is not None) == (kernels is None)
    rows = [geo.typed(record, pos) for pos in (POS_MASTER, POS_EXP_AVG, POS_EXP_AVG_SQ)]
    codec.encode_master(awkward(numel, seed=9), rows[0], (0, 1, 1))
    codec.encode_moment(awkward(numel, seed=1), rows[1], True)
    codec.encode_moment(awkward(numel, seed=2, signed=False), rows[2], False)
    out = [record.clone()]
    gen = torch.Generator().manual_seed(5)
    for step in (1, 2):
        grad = torch.randn(numel, generator=gen) * 1e-2
        count_t = torch.tensor(float(step))
        for lo, hi, master_C, m_C, v_C in codec.chunks(*rows, numel, (1, 2, step)):
            adamw([master_C], [grad[lo:hi]], [m_C], [v_C], [], [count_t.fill_(step)],
                  fused=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-2,
                  weight_decay=0.1, eps=1e-8, maximize=False)
        out.append(record.clone())
    out += [codec.decode_master(rows[0], numel).clone(),
            codec.decode_moment(rows[1], numel, True, "m").clone(),
            codec.decode_moment(rows[2], numel, False, "v").clone()]
    return out


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("numel", [256, 4 * 512 + 37])
def test_c_loops_are_bitwise_the_torch_ops(fmt, numel):
    fast, slow = run(fmt, None, numel), run(fmt, False, numel)
    for i, (a, b) in enumerate(zip(fast, slow)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"stage {i} differs"


@pytest.mark.parametrize("fmt", FORMATS[:2], ids=lambda f: f.name)
@pytest.mark.parametrize("numel", [300, NOISE_NUMBERS + 3 * 256 + 5])
def test_one_pass_int8_adamw_is_bitwise_its_reference(fmt, numel):
    """compact_adamw.step_compact with the C loop (decode, AdamW, encode per block) against
    step_reference (the codec's chunks and adamw_reference in torch ops), over 3 steps: every
    byte of the record (an expert over one noise part, for a bf16 master's second part)."""
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    records = []
    for kernels in (None, False):
        geo = RecordGeometry(fmt, numel)
        record = torch.zeros(geo.total, dtype=torch.uint8)
        codec = StateCodec(fmt, kernels=kernels)
        rows = tuple(geo.typed(record, pos) for pos in (POS_MASTER, POS_EXP_AVG, POS_EXP_AVG_SQ))
        codec.encode_master(awkward(numel, seed=9).clamp(-4, 4), rows[0], (0, 1, 0))
        gen = torch.Generator().manual_seed(3)
        for step in (1, 2, 3):
            grad = torch.randn(numel, generator=gen) * 10.0 ** -step
            grad[:256] = 0.0
            if kernels is None:
                step_compact(codec, rows, grad, numel, (0, 5, step), hp, None)
            else:
                step_reference(codec, rows, grad, numel, (0, 5, step), hp)
        records.append(record)
    assert torch.equal(records[0], records[1])


def test_exact_state_and_forced_torch_ops_take_no_kernels():
    assert StateCodec(StateFormat()).kernels is None
    assert StateCodec(FORMATS[0], kernels=False).kernels is None


def test_the_build_is_keyed_by_this_cpu(monkeypatch, tmp_path):
    """Another CPU's feature flags name another library: a cache shared between hosts never
    loads a build for instructions this CPU lacks."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cc = codec_kernels._compiler()
    first = codec_kernels._compile(cc)
    monkeypatch.setattr(codec_kernels, "_cpu", lambda: "x86_64 another-cpu sse2")
    other = codec_kernels._compile(cc)
    assert first is not None and other is not None and first != other
    assert first.parent == other.parent == tmp_path / "moescale" / "kernels"
