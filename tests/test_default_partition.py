"""The shape-chosen default partition size (cpa.variants BY_SHAPE): the wave model's choice by
hand, and the launcher's selection with a stand-in for the device's occupancy query (CPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cpa import ops
from cpa import occupancy as O
from cpa import variants as V
from cpa.inputs import make_paged_inputs
from cpa.validation import validate_paged_attention_args

H200_SMS = 132


def model(t_wave_us=1.69, gbps=4517.0):
    return O.WaveModel(gbps * 1e9, t_wave_us, 0.0, 0.0, "test")


def pick(num_seqs, max_seq_len, *, slots=2 * H200_SMS, num_kv_heads=8, num_heads=64, head_size=128, elem=2,
         candidates=None, m=None):
    cands = candidates or V.partition_candidates(tiling="mfma16", head_size=head_size, block_size=16, dtype="fp16",
                                                 kv_cache_dtype="auto", gqa_ratio=num_heads // num_kv_heads,
                                                 platform="cuda", max_seq_len=max_seq_len)
    return O.partition_by_wave_model(m or model(), cands, num_seqs=num_seqs, num_heads=num_heads,
                                     num_kv_heads=num_kv_heads, head_size=head_size, max_seq_len=max_seq_len,
                                     kv_elem_bytes=elem, slots=slots, compute_units=H200_SMS)


@pytest.mark.parametrize("num_seqs,max_seq_len,want", [
    # one wave of 256 workgroups (<= 264 slots, every SM busy) is the fastest grid the model has
    (1, 32768, 1024), (8, 32768, 8192), (8, 8192, 2048), (1, 8192, 256),
    # 4 x 1k: 128 workgroups at 256 leave 4 SMs idle, 256 at 128 busy them all, both one wave:
    # the twice smaller partials of 256 outweigh 4 idle SMs (the sweep's best there is 256 too)
    (4, 1024, 256),
    # more (sequence, KV head) pairs than slots: one partition each, the fewest waves
    (128, 8192, 8192), (32, 2048, 2048), (32, 512, 512),
    # the shortest context: the one candidate
    (1, 100, 128),
])
def test_wave_model_choice_by_hand(num_seqs, max_seq_len, want):
    assert pick(num_seqs, max_seq_len) == want


def test_wave_model_choice_by_hand_arithmetic():
    """8 x 32k: P 4096 gives 512 workgroups = 2 waves, P 8192 256 = 1 wave; same busy SMs and
    bytes up to the partials, so the wave cost decides -- checked against the formula."""
    m = model()
    kv = 2 * 8 * 32768 * 8 * 128 * 2

    def t(p):
        parts = 32768 // p
        wg = 8 * 8 * parts
        one = 8 * 64 * parts * 130 * 4
        waves = -(-wg // 264)
        fill = min(wg / waves, 132) / 132
        return (kv + one) / (m.bw_bytes_per_s * fill) * 1e6 + one / m.bw_bytes_per_s * 1e6 + m.t_wave_us * waves

    assert t(8192) < t(4096) < t(2048)
    # the formula is the model's: WaveModel.time_us, and the times partition_by_wave_model compares
    times = O.wave_model_times(m, [2048, 4096, 8192], num_seqs=8, num_heads=64, num_kv_heads=8, head_size=128,
                               max_seq_len=32768, kv_elem_bytes=2, slots=264, compute_units=132)
    for p in (2048, 4096, 8192):
        parts = 32768 // p
        wg, one = 8 * 8 * parts, 8 * 64 * parts * 130 * 4
        got = m.time_us(workgroups=wg, waves=-(-wg // 264), compute_units=132, partitions=parts, kv_bytes=kv,
                        partials_written=one, partials_read=one, slots=264)
        assert got == pytest.approx(t(p), rel=1e-12), p
        assert times[p] == pytest.approx(t(p), rel=1e-12), p
    assert pick(8, 32768, candidates=[2048, 4096, 8192]) == 8192
    # with three workgroups per SM (396 slots) P 4096's 512 workgroups still take 2 waves
    assert pick(8, 32768, slots=3 * H200_SMS, candidates=[2048, 4096, 8192]) == 8192


def test_a_short_last_wave_streams_at_its_own_fill():
    """3 x 128k at P 8192: 384 workgroups on 264 slots are a full wave and one of 120 (120 SMs
    busy), not two waves of 192 with every SM busy, as averaging the waves counted them. Wave
    by wave the model picks 4096 (768 workgroups, the last wave of 240 still busies every SM);
    the H200 measured 363.7 us at 4096 against 391.7 at 8192
    (data/bench/experiments/h200-target2-odd-2ae03da.csv)."""
    m = model()
    kv = 2 * 3 * 131072 * 8 * 128 * 2
    one = 3 * 64 * 16 * 130 * 4  # P 8192: 16 partitions
    per_wg = (kv + one) / 384
    want = per_wg * (264 / 1.0 + 120 / (120 / 132)) / m.bw_bytes_per_s * 1e6 + one / m.bw_bytes_per_s * 1e6 \
        + 2 * m.t_wave_us
    got = m.time_us(workgroups=384, waves=2, compute_units=132, partitions=16, kv_bytes=kv, partials_written=one,
                    partials_read=one, slots=264)
    assert got == pytest.approx(want, rel=1e-12)
    def averaged(wg, waves, kv, one):  # the model before: the workgroups averaged over the waves
        fill = min(wg / waves, 132) / 132
        return (kv + one) / (m.bw_bytes_per_s * fill) * 1e6 + one / m.bw_bytes_per_s * 1e6 + m.t_wave_us * waves

    assert averaged(384, 2, kv, one) < got  # the average hid the short wave
    assert pick(3, 131072, candidates=[4096, 8192]) == 4096
    # full waves only: the same time either way (8 x 32k at 4096: 512 workgroups, the last wave 248)
    kv32 = 2 * 8 * 32768 * 8 * 128 * 2
    assert m.time_us(workgroups=512, waves=2, compute_units=132, partitions=8, kv_bytes=kv32, partials_written=0,
                     partials_read=0, slots=264) == pytest.approx(averaged(512, 2, kv32, 0), rel=1e-12)


def test_more_slots_pick_smaller_partitions_until_every_sm_is_busy():
    # 1 x 32k: at one workgroup per SM 2048 (128 workgroups, one wave), at two 1024 (256)
    assert pick(1, 32768, slots=H200_SMS) == 2048
    assert pick(1, 32768) == 1024
    # the model counts busy SMs, not busy slots: past one wave with every SM busy, more slots
    # per SM buy nothing (32 x 8k: 256 workgroups at 8192 in one wave from 2 per SM up)
    assert pick(32, 8192) == pick(32, 8192, slots=4 * H200_SMS) == 8192


def test_ties_go_to_the_larger_partition():
    # a context shorter than every candidate: the same single partition, the same time
    assert pick(4, 100, candidates=[128, 256, 512]) == 512


def test_wave_model_choice_refuses_nonsense():
    kw = dict(num_seqs=1, num_heads=64, num_kv_heads=8, head_size=128, max_seq_len=1024, kv_elem_bytes=2,
              compute_units=H200_SMS)
    with pytest.raises(ValueError, match="no candidate"):
        O.partition_by_wave_model(model(), [], slots=264, **kw)
    with pytest.raises(ValueError, match="slots"):
        O.partition_by_wave_model(model(), [256], slots=0, **kw)


# ------------------------------------------------------------------ the launcher's selection
def shape_of(num_seqs, max_seq_len, *, num_heads=64, num_kv_heads=8, kv_cache_dtype="auto", max_seq_len_known=True):
    """A validated shape of small CPU inputs with the sizes the selection reads replaced."""
    inp = make_paged_inputs(1, num_heads, num_kv_heads, 128, 16, [40], dtype=torch.float16,
                            kv_cache_dtype=kv_cache_dtype)
    s = validate_paged_attention_args(**inp.as_kwargs(), head_sizes=V.HEAD_SIZES, block_sizes=V.BLOCK_SIZES)
    return dataclasses.replace(s, num_seqs=num_seqs, max_seq_len=max_seq_len if max_seq_len_known else None)


class Resident:
    """A stand-in for the device's occupancy query: records the variants it is asked about."""

    def __init__(self, per_sm):
        self.per_sm, self.asked = per_sm, []

    def __call__(self, v):
        self.asked.append(v)
        return self.per_sm


def select(shape, resident, **kw):
    return ops.select_variant(shape, tiling=kw.pop("tiling", None), partition_size=kw.pop("partition_size", None),
                              platform=kw.pop("platform", "cuda"), arch=kw.pop("arch", "sm_90"),
                              resident_per_sm=resident, compute_units=H200_SMS, **kw)


def test_sm90_default_partition_follows_the_shape():
    r = Resident(2)
    for (b, L), want in {(8, 32768): 8192, (1, 32768): 1024, (8, 8192): 2048, (32, 512): 512}.items():
        v = select(shape_of(b, L), r)
        assert (v.tiling, v.partition_size) == ("mfma16", want), (b, L)
    # asked once per call, about the variant its guess of 2 per SM picks (no second build then)
    assert [a.partition_size for a in r.asked] == [8192, 1024, 2048, 512]


def test_sm90_default_partition_uses_the_measured_occupancy():
    # 1 x 32k: the guess (2 per SM) picks 1024; a variant that fits 1 per SM gets 2048
    r = Resident(1)
    v = select(shape_of(1, 32768), r)
    assert v.partition_size == 2048 and [a.partition_size for a in r.asked] == [1024]
    with pytest.raises(ValueError, match="fits an SM"):
        select(shape_of(1, 32768), Resident(0))


def test_explicit_partition_and_amd_default_skip_the_model():
    r = Resident(2)
    assert select(shape_of(8, 32768), r, partition_size=512).partition_size == 512
    assert select(shape_of(8, 32768), r, platform="hip", arch="gfx942").partition_size == 256
    assert r.asked == []
    # a tiling alone keeps the shape-chosen partition size
    assert select(shape_of(8, 32768), r, tiling="mfma4").partition_size == 8192


def test_shape_choice_respects_what_the_launch_allows():
    # shared steps need >= 256 tokens per partition: 1 x 200 tokens then gets 256, not 128
    allowed = lambda v: V.shared_steps_unsupported(v) is None  # noqa: E731
    assert select(shape_of(1, 200), Resident(2)).partition_size == 128
    assert select(shape_of(1, 200), Resident(2), allowed=allowed).partition_size == 256
    assert select(shape_of(1, 5000), Resident(2), allowed=allowed).partition_size >= 256


def test_shape_choice_needs_the_context_length_and_a_model(monkeypatch):
    with pytest.raises(ValueError, match="max_seq_len"):
        select(shape_of(8, 1000, max_seq_len_known=False), Resident(2))
    monkeypatch.setitem(V.DEFAULTS, "sm_100", [(16, "mfma16", V.BY_SHAPE, "a rule without a model")])
    with pytest.raises(ValueError, match="no wave model"):
        select(shape_of(8, 1000), Resident(2), arch="sm_100")


def test_resident_per_sm_asks_once_per_variant_without_its_partition_size(monkeypatch):
    """ops.resident_per_sm builds and queries a variant once; other partition sizes of it reuse
    the answer (same registers and shared memory), any other axis or device asks again."""
    built = []

    class Kernel:
        def __init__(self, v):
            self.v = v

        def attributes(self):
            return {"attention": {"blocks_per_sm": 3 if self.v.head_size == 64 else 2},
                    "attention_shared_steps": {"blocks_per_sm": 2 if self.v.head_size == 64 else 1}}

    monkeypatch.setattr(ops, "_resident", {})
    monkeypatch.setattr(ops, "build", lambda v, device: built.append((v, device)) or Kernel(v))
    v = V.variant_for(tiling="mfma16", partition_size=512, head_size=128, block_size=16, dtype="fp16",
                      kv_cache_dtype="auto", gqa_ratio=8, platform="cuda")
    assert ops.resident_per_sm(v, "cuda:0") == 2
    assert ops.resident_per_sm(dataclasses.replace(v, partition_size=4096), "cuda:0") == 2
    assert len(built) == 1
    assert ops.resident_per_sm(dataclasses.replace(v, head_size=64), "cuda:0") == 3
    assert ops.resident_per_sm(v, "cuda:1") == 2
    assert len(built) == 3
    # the shared-steps kernel is asked separately (its own registers)
    assert ops.resident_per_sm(v, "cuda:0", shared_steps=True) == 1
    assert ops.resident_per_sm(dataclasses.replace(v, head_size=64), "cuda:0", shared_steps=True) == 2
    assert ops.resident_per_sm(v, "cuda:0") == 2


# ------------------------------------------------------------ the variants audit
def _shape(num_heads=16, num_kv_heads=2):
    import torch

    from cpa.inputs import make_paged_inputs
    from cpa.validation import validate_paged_attention_args

    inp = make_paged_inputs(2, num_heads, num_kv_heads, 128, 16, [40, 100], dtype=torch.float16)
    return validate_paged_attention_args(**inp.as_kwargs())


def test_a_bad_tiling_is_refused_as_such_with_a_shape_chosen_size():
    """With partition_size=None on sm_90 a misspelt tiling read 'no partition size fits'."""
    import pytest

    from cpa import ops

    kw = dict(partition_size=None, platform="cuda", arch="sm_90", resident_per_sm=lambda v: 2, compute_units=132)
    with pytest.raises(ValueError, match="tiling='MFMA16' is not supported"):
        ops.select_variant(_shape(), tiling="MFMA16", **kw)
    with pytest.raises(ValueError, match="GQA ratio num_heads/num_kv_heads=17 is not supported"):
        ops.select_variant(_shape(num_heads=34), tiling="scalar", **kw)


def test_shared_steps_take_the_next_size_up_from_a_fixed_default():
    """gfx942's default for GQA <= 4 is mfma4 at 256, too short for shared steps (512 there): the
    launcher takes 512 instead of refusing a size the caller never gave; without the option, 256."""
    from cpa import ops
    from cpa import variants as V

    s = _shape(num_heads=8, num_kv_heads=2)
    allowed = lambda v: V.shared_steps_unsupported(v) is None  # noqa: E731
    kw = dict(tiling=None, partition_size=None, platform="hip", arch="gfx942")
    assert ops.select_variant(s, allowed=allowed, **kw).name == "mfma4-p512-h128-b16-fp16-kvauto-g4-hip"
    assert ops.select_variant(s, **kw).name == "mfma4-p256-h128-b16-fp16-kvauto-g4-hip"


def test_wave_model_predict_counts_an_fp8_cache_at_one_byte():
    from cpa import occupancy as O

    shape = [dict(num_seqs=8, num_heads=64, num_kv_heads=8, max_seq_len=32768)]
    m = O.shape_model("sm_90")
    for kv, elem in (("auto", 2), ("fp8", 1)):
        g = O.grid_table("sm_90", shape, tilings=["mfma16"], partition_sizes=[8192], kv_cache_dtype=kv)
        t = O.wave_model_times(m, [8192], num_seqs=8, num_heads=64, num_kv_heads=8, head_size=128, max_seq_len=32768,
                               kv_elem_bytes=elem, slots=int(g.slots.iloc[0]), compute_units=132)[8192]
        assert abs(float(m.predict(g).iloc[0]) - t) < 1e-9 and int(g.kv_elem_bytes.iloc[0]) == elem
