"""Compact expert state formats on small tensors (offload/state_format.py): the int8 block-wise
quantiser bitwise against its definition, dequantise -> quantise the identity, its error bound,
bf16 moments rounded to nearest, the bf16 master's stochastic rounding (unbiased, one of the two
neighbours, keyed by (seed, layer, expert, step)), fp32 records laid out as before, and one
compact AdamW step of the host optimizer against its reference on the decoded state, the
reference against torch's AdamW within rounding."""

import pytest
import torch
from torch.optim.adamw import adamw

from moescale.offload import codec_kernels
from moescale.offload.compact_adamw import adamw_hparams, adamw_reference
from moescale.offload.direct_io import align_up
from moescale.offload.optimizer import AdamWConfig, HostOptimizer
from moescale.offload.records import POS_EXP_AVG, POS_EXP_AVG_SQ, POS_GRAD, POS_MASTER
from moescale.offload.int8_codes import BLOCK, dynamic_map, quantize_reference
from moescale.offload.state_format import RecordGeometry, StateCodec, StateFormat
from moescale.offload.store import ExpertLayout, ExpertStore, StoreConfig

INT8 = StateFormat(master="bf16", moments="int8", seed=7)


def awkward(numel: int, seed: int = 0, signed: bool = True) -> torch.Tensor:
    """Values over 12 decades, a zero block, a block whose absmax is negative, a lone value."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * 10.0 ** torch.randint(-10, 2, (numel,), generator=gen)
    if numel >= 4 * BLOCK:
        x[:BLOCK] = 0.0
        x[BLOCK:2 * BLOCK] = x[BLOCK:2 * BLOCK].clamp(-1, 1)
        x[BLOCK + 5] = -3.0
        x[2 * BLOCK:3 * BLOCK] = 0.0
        x[2 * BLOCK + 17] = 2.5e-3
    return x if signed else x.abs()


def reference_row(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_reference of x padded with zeros to whole blocks: (codes, scales)."""
    nb = -(-x.numel() // BLOCK)
    padded = torch.zeros(nb * BLOCK)
    padded[:x.numel()] = x
    return quantize_reference(padded, signed)


def encode(x: torch.Tensor, signed: bool) -> torch.Tensor:
    geo = RecordGeometry(INT8, x.numel())
    record = torch.zeros(geo.total, dtype=torch.uint8)
    StateCodec(INT8).encode_moment(x.clone(), geo.row(record, POS_EXP_AVG), signed)
    return geo.row(record, POS_EXP_AVG).clone()


@pytest.mark.parametrize("numel", [BLOCK, 1000, 4 * BLOCK + 37])
@pytest.mark.parametrize("signed", [True, False])
def test_int8_quantiser_is_its_definition_bitwise(numel, signed):
    x = awkward(numel, signed=signed)
    row = encode(x, signed)
    nb = -(-numel // BLOCK)
    codes, scales = reference_row(x, signed)
    assert torch.equal(row[:nb * BLOCK], codes)
    assert torch.equal(row[nb * BLOCK:].view(torch.float32), scales)


@pytest.mark.parametrize("signed", [True, False])
def test_int8_dequantise_then_quantise_is_the_identity(signed):
    """Over a million numbers (codes one bf16 step apart included: a table of 16-bit buckets
    flipped ~25 of them to the neighbouring code), every code and scale comes back."""
    numel = 4096 * BLOCK + 11
    x = torch.rand(numel, generator=torch.Generator().manual_seed(4)) * 3.0
    x[:6 * BLOCK + 11] = awkward(6 * BLOCK + 11, seed=3, signed=signed)
    row = encode(x if signed else x.abs(), signed)
    decoded = StateCodec(INT8).decode_moment(row, numel, signed, "m").clone()
    assert torch.equal(encode(decoded, signed), row)          # codes and scales, bitwise
    assert torch.equal(StateCodec(INT8).decode_moment(encode(decoded, signed), numel, signed,
                                                      "m"), decoded)


@pytest.mark.parametrize("signed", [True, False])
def test_int8_error_within_half_a_code_step_of_the_block_scale(signed):
    numel = 64 * BLOCK
    x = torch.randn(numel, generator=torch.Generator().manual_seed(5))
    x = x if signed else x.square()
    decoded = StateCodec(INT8).decode_moment(encode(x, signed), numel, signed, "m")
    absmax_nB = x.view(-1, BLOCK).abs().amax(1, keepdim=True)
    code = dynamic_map(signed)
    half_gap = float((code[1:] - code[:-1]).max()) / 2 + 2 ** -8   # + the bf16 pre-rounding
    err_nB = (decoded - x).view(-1, BLOCK).abs() / absmax_nB
    assert float(err_nB.max()) <= half_gap
    assert float(err_nB.mean()) < 0.01
    if not signed:                       # a second moment never decodes negative
        assert bool((decoded >= 0).all())


def test_zero_bytes_decode_to_zero_moments():
    """A record's zero tail (a new store's moments) is a zero moment in every format."""
    for fmt in (INT8, StateFormat(moments="bf16")):
        geo = RecordGeometry(fmt, 1000)
        record = torch.zeros(geo.total, dtype=torch.uint8)
        for pos, signed in ((POS_EXP_AVG, True), (POS_EXP_AVG_SQ, False)):
            got = StateCodec(fmt).decode_moment(geo.typed(record, pos), 1000, signed, "m")
            assert torch.equal(got, torch.zeros(1000))


def test_bf16_moments_round_to_nearest():
    fmt = StateFormat(moments="bf16")
    x = awkward(1000)
    geo = RecordGeometry(fmt, 1000)
    record = torch.zeros(geo.total, dtype=torch.uint8)
    StateCodec(fmt).encode_moment(x.clone(), geo.typed(record, POS_EXP_AVG), True)
    assert torch.equal(geo.typed(record, POS_EXP_AVG), x.to(torch.bfloat16))


def test_stochastic_rounding_unbiased_neighbours_and_keyed():
    n = 1 << 16
    x = torch.linspace(-3, 3, n) + 1e-3
    codec = StateCodec(StateFormat(master="bf16", seed=11))
    out = []
    for where in ((0, 1, 5), (0, 1, 5), (0, 1, 6), (1, 1, 5)):
        row = torch.empty(n, dtype=torch.bfloat16)
        codec.encode_master(x.clone(), row, where)
        out.append(row.float())
    down = x.to(torch.bfloat16).float()
    lo = torch.where(down <= x, down, torch.nextafter(down.to(torch.bfloat16),
                                                        torch.tensor(-1e9, dtype=torch.bfloat16)
                                                        ).float())
    hi = torch.where(down >= x, down, torch.nextafter(down.to(torch.bfloat16),
                                                        torch.tensor(1e9, dtype=torch.bfloat16)
                                                        ).float())
    for got in out:
        assert bool(((got == lo) | (got == hi)).all())
    assert torch.equal(out[0], out[1])                    # same key: bitwise the same
    assert not torch.equal(out[0], out[2]) and not torch.equal(out[0], out[3])
    other_seed = torch.empty(n, dtype=torch.bfloat16)
    StateCodec(StateFormat(master="bf16", seed=12)).encode_master(x.clone(), other_seed,
                                                                  (0, 1, 5))
    assert not torch.equal(out[0], other_seed.float())
    # unbiased: a value 1/4 of the way between two bf16 numbers rounds up a quarter of the time
    base = torch.full((n,), 1.0)
    step = 2.0 ** -7
    row = torch.empty(n, dtype=torch.bfloat16)
    codec.encode_master(base + step / 4, row, (0, 0, 1))
    assert abs(float((row.float() > 1.0).float().mean()) - 0.25) < 0.01


def test_fp32_records_keep_the_earlier_layout():
    for numel in (1000, 1024, 5000):
        geo = RecordGeometry(StateFormat(), numel)
        assert geo.offsets == [p * align_up(4 * numel) for p in range(5)]


def test_compact_step_against_its_reference_on_the_decoded_state():
    """The host optimizer's compact step = decode, AdamW, encode: the moments' codes are
    bitwise the quantiser's of the update's result, the master one of the two bf16 numbers
    around it (stochastic rounding), over 4 steps. The update: compact_adamw.adamw_reference
    where the C loop is built, else torch's fused AdamW (compact_adamw.py)."""
    layout = ExpertLayout([("w", (8, 3 * BLOCK + 5))])
    numel = layout.numel
    store = ExpertStore(StoreConfig(tier="host", state=INT8))
    gen = torch.Generator().manual_seed(0)
    store.add_layer(layout, 2, lambda e: torch.randn(numel, generator=gen))
    config = AdamWConfig(lr=1e-2, weight_decay=0.1, impl="fused")
    opt = HostOptimizer(store, config)
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    try:
        for step in range(1, 5):
            grad = torch.randn(numel, generator=gen) * 10.0 ** -step
            master, m, v = store.get_state((0, 1))
            if codec_kernels.load() is not None:
                adamw_reference(master, grad.clone(), m, v, adamw_hparams(hp, step))
            else:
                adamw([master], [grad.clone()], [m], [v], [], [torch.tensor(step - 1.0)],
                      fused=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-2,
                      weight_decay=0.1, eps=1e-8, maximize=False)
            opt.accumulate((0, 1), [grad.view(8, -1)], last=True)
            opt.wait_all()
            rec = store.acquire((0, 1))
            try:
                for row, want, signed in ((rec.exp_avg_P, m, True), (rec.exp_avg_sq_P, v, False)):
                    nb = -(-numel // BLOCK)
                    codes, scales = reference_row(want, signed)
                    assert torch.equal(row[:nb * BLOCK], codes)
                    assert torch.equal(row[nb * BLOCK:].view(torch.float32), scales)
                got = rec.master_P.float()
                near = master.to(torch.bfloat16).float()
                ulp = (torch.nextafter(near.abs().to(torch.bfloat16),
                                       torch.tensor(1e9, dtype=torch.bfloat16)).float()
                       - near.abs())
                assert bool(((got - master).abs() <= ulp).all())
                assert float(rec.step_t) == step
            finally:
                store.release((0, 1))
    finally:
        opt.close()
        store.close()


def test_compact_adamw_is_torch_adamw_within_rounding():
    """The compact AdamW's formula is torch's AdamW: over 20 steps on fp32 tensors, master and
    moments within 1e-5 relative or 1e-6 of the tensor's largest magnitude of torch's fused
    kernel (the documented tolerance: the two round some operations in another order, and a
    moment that cancels to near zero keeps the difference of its terms' roundings)."""
    gen = torch.Generator().manual_seed(1)
    p_ref = torch.randn(4096, generator=gen)
    ours = [p_ref.clone(), torch.zeros(4096), torch.zeros(4096)]
    theirs = [p_ref.clone(), torch.zeros(4096), torch.zeros(4096)]
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    count_t = torch.tensor(0.0)
    for step in range(1, 21):
        grad = torch.randn(4096, generator=gen) * 10.0 ** -(step % 4)
        adamw_reference(ours[0], grad, ours[1], ours[2], adamw_hparams(hp, step))
        adamw([theirs[0]], [grad], [theirs[1]], [theirs[2]], [], [count_t], fused=True,
              amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-3, weight_decay=0.01, eps=1e-8,
              maximize=False)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


def test_formats_refused_with_the_fix():
    from moescale.offload import OffloadConfig
    with pytest.raises(ValueError, match="moments='int4' is unknown; use one of fp32, bf16, int8"):
        OffloadConfig(tier="host", moments="int4")
    with pytest.raises(ValueError, match="resident experts keep fp32 state"):
        OffloadConfig(tier="device-only", master="bf16")
    with pytest.raises(ValueError, match="shared between processes holds fp32 records only"):
        OffloadConfig(tier="host", moments="int8", shared_memory=True)
    with pytest.raises(ValueError, match="shared between processes holds fp32 records only"):
        StoreConfig(tier="host", shared_memory=True, state=INT8)
    assert RecordGeometry(INT8, 1000).offsets[POS_GRAD] == \
        align_up(2000) + 2 * align_up(4 * BLOCK + 16)
    assert RecordGeometry(INT8, 1000).strides[POS_MASTER] == align_up(2000)


@pytest.mark.parametrize("fmt", [INT8, StateFormat(master="fp32", moments="int8"),
                                 StateFormat(master="bf16", moments="bf16", seed=3)],
                         ids=lambda f: f.name)
def test_chunked_codec_is_bitwise_the_whole_row_one(fmt):
    """The codec's chunks (here 512 numbers: several chunks and a last partial block) give
    bitwise the records of one chunk over the whole row, through an AdamW step driven by
    `chunks` and through the whole-row encode/decode methods."""
    numel = 5 * 512 + 37
    geo = RecordGeometry(fmt, numel)
    gen = torch.Generator().manual_seed(5)
    grad = torch.randn(numel, generator=gen) * 1e-2
    base = torch.zeros(geo.total, dtype=torch.uint8)
    whole = StateCodec(fmt, chunk=1 << 22)
    whole.encode_master(torch.randn(numel, generator=gen), geo.typed(base, POS_MASTER), (0, 0, 0))
    for pos, signed in ((POS_EXP_AVG, True), (POS_EXP_AVG_SQ, False)):
        x = awkward(numel, seed=pos, signed=signed)
        whole.encode_moment(x.abs() if not signed else x, geo.typed(base, pos), signed)
    records = []
    for chunk in (512, 1 << 22):
        codec, record = StateCodec(fmt, chunk=chunk), base.clone()
        rows = [geo.typed(record, pos) for pos in (POS_MASTER, POS_EXP_AVG, POS_EXP_AVG_SQ)]
        count_t = torch.tensor(3.0)
        for lo, hi, master_C, m_C, v_C in codec.chunks(*rows, numel, (1, 2, 4)):
            adamw([master_C], [grad[lo:hi]], [m_C], [v_C], [], [count_t.fill_(3.0)],
                  fused=True, amsgrad=False, beta1=0.9, beta2=0.999, lr=1e-2,
                  weight_decay=0.1, eps=1e-8, maximize=False)
        records.append(record)
        decoded = [codec.decode_master(rows[0], numel).clone(),
                   codec.decode_moment(rows[1], numel, True, "m").clone(),
                   codec.decode_moment(rows[2], numel, False, "v").clone()]
        records.append(torch.cat([d.view(torch.uint8) for d in decoded]))
    assert torch.equal(records[0], records[2])
    assert torch.equal(records[1], records[3])
    with pytest.raises(ValueError, match="multiple of 256 dividing"):
        StateCodec(fmt, chunk=1000)
