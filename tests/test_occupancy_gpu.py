"""On an NVIDIA GPU (the H200): cpa.occupancy.hopper_occupancy equals the CUDA runtime's
cudaOccupancyMaxActiveBlocksPerMultiprocessor (through BuiltKernel.attributes()) for the
attention and reduce kernels of a representative set of variants.

Record the table with:
    python -c "import cpa.occupancy as O, tests.test_occupancy_gpu as T; \
               O.h200_check(T.VARIANTS).to_csv('data/static/h200-occupancy-check.csv', index=False)"
"""

from __future__ import annotations

import os

import pytest
import torch

from cpa import variants as V

pytestmark = pytest.mark.gpu


def _v(tiling, p, h, b, dt, kv, cap):
    return V.Variant(tiling, p, h, b, dt, kv, cap, "cuda")


# every tiling and heads cap, small and large heads / partitions, fp8 and bf16; the scalar
# cap-16 head-256 variant has the largest static shared memory of the set
VARIANTS = [
    _v("mfma16", 256, 128, 16, "fp16", "auto", 8),
    _v("mfma16", 256, 128, 16, "fp16", "auto", 16),
    _v("mfma16", 512, 256, 16, "bf16", "fp8", 16),
    _v("mfma16", 64, 64, 32, "fp16", "auto", 8),
    _v("mfma4", 256, 128, 16, "fp16", "auto", 8),
    _v("mfma4", 1024, 256, 32, "bf16", "auto", 16),
    _v("scalar", 256, 128, 16, "fp16", "auto", 1),
    _v("scalar", 256, 128, 16, "fp16", "fp8", 8),
    _v("scalar", 1024, 256, 16, "fp16", "auto", 16),
    _v("scalar", 64, 64, 32, "bf16", "auto", 4),
]


def _nvidia():
    return torch.cuda.is_available() and not getattr(torch.version, "hip", None)


@pytest.fixture(scope="module")
def check():
    if not _nvidia():
        pytest.skip("needs an NVIDIA GPU (Hopper model vs cudaOccupancyMaxActiveBlocksPerMultiprocessor)")
    from cpa import occupancy as O
    from cpa.jit import device_arch, prebuild

    _, arch = device_arch()
    if arch != "sm_90":
        pytest.skip(f"the Hopper model is for sm_90; this GPU is {arch}")
    errors = [r for r in prebuild(VARIANTS, arch, progress=False) if r["error"]]
    assert not errors, errors
    table = O.h200_check(VARIANTS)
    dest = os.environ.get("CPA_OCCUPANCY_CSV")  # scripts/h200.sh: record the table of this run
    if dest:
        tmp = dest + ".tmp"
        table.to_csv(tmp, index=False)
        os.replace(tmp, dest)
    return table


def test_model_equals_cuda_occupancy(check):
    assert len(check) == 4 * len(VARIANTS)  # attention, reduce, reduce_few, attention_shared_steps
    assert set(check.kernel) == {"attention", "reduce", "reduce_few", "attention_shared_steps"}
    bad = check[~check["match"]]
    assert bad.empty, "hopper_occupancy != cudaOccupancyMaxActiveBlocksPerMultiprocessor:\n" + bad[
        ["variant", "kernel", "registers", "shared_bytes", "threads_per_block", "blocks_per_sm_cuda",
         "blocks_per_sm_model", "model_limit"]].to_string()


def test_device_matches_spec(check):
    from cpa import hardware as hw

    r = check.iloc[0]
    assert r["device_sms"] == hw.H200.compute_units
    if r["device_regs_per_sm"] is not None:
        assert r["device_regs_per_sm"] == hw.H200.regs_per_sm
    if r["device_smem_per_sm"] is not None:
        assert r["device_smem_per_sm"] == hw.H200.smem_per_sm


def test_shared_steps_kernel_holds_its_own_blocks_per_sm():
    """The shared-steps instantiation's occupancy is its own (attributes()["attention_shared_steps"]),
    and a shape-chosen partition size with shared_steps=True reads it: at head 64 GQA 16 the
    compiled tables give it more registers than the fixed kernel and a block per SM fewer."""
    if not _nvidia():
        pytest.skip("needs an NVIDIA GPU")
    from cpa import ops
    from cpa.jit import build, device_arch
    from cpa.occupancy import hopper_occupancy

    if device_arch()[1] != "sm_90":
        pytest.skip("the compiled tables are sm_90's")
    v = _v("mfma16", 256, 64, 16, "bf16", "auto", 16)  # compiled: 185 against 164 registers, 2 against 3 blocks
    a = build(v).attributes()
    fixed, shared = a["attention"], a["attention_shared_steps"]
    assert shared["registers"] > fixed["registers"] and shared["threads_per_block"] == 128
    model = hopper_occupancy(shared["registers"], shared["shared_bytes"], shared["threads_per_block"])
    assert shared["blocks_per_sm"] == model.blocks_per_sm < fixed["blocks_per_sm"]
    assert ops.resident_per_sm(v, "cuda", shared_steps=True) == shared["blocks_per_sm"]
    assert ops.resident_per_sm(v, "cuda") == fixed["blocks_per_sm"]
