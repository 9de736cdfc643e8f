"""benchmarks/probe_model_step.py's accounting, on made-up intervals and kernel names (the
probe itself needs a GPU): the busy time is the union of the activities, gaps are
measured from the latest end, and kernels are sorted into the kinds its table reports."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import probe_model_step as probe  # noqa: E402  (a benchmark script, not a package)


def test_busy_time_is_the_union_and_a_nested_activity_opens_no_gap():
    intervals = [(0.0, 10.0, "a"), (2.0, 4.0, "inside a"), (8.0, 12.0, "overlaps a"), (15.0, 16.0, "b"),
                 (20.0, 21.0, "c")]
    busy, gaps = probe.busy_and_gaps(intervals)
    assert busy == 12.0 + 1.0 + 1.0
    assert gaps == [(3.0, "overlaps a", "b"), (4.0, "b", "c")]


def test_no_activity_gives_nothing():
    assert probe.busy_and_gaps([]) == (0.0, [])


@pytest.mark.parametrize("name, kind", [
    ("split_kernel", "forge fused step"),
    ("_fused_weight_update_kernel", "forge fused step"),
    ("_finite_check_kernel", "forge checks"),
    ("_norm_kernel", "forge tile norms"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)"
     "::FusedOptimizerTensorListMetadata<4>, ...>", "torch optimizer"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)"
     "::TensorListMetadata<1>, at::native::(anonymous namespace)::LpNormFunctor<float, 2>>", "foreach"),
    ("void at::native::reduce_kernel<128, 4, at::native::ReduceOp<float, at::native::NormTwoOps<float>>>",
     "reductions"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, true>",
     "rms/layer norms"),
    ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "matrix products"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::bfloat16_copy_kernel_cuda>",
     "copies, casts and fills"),
    ("Memset (Unknown)", "copies, casts and fills"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float>>", "element-wise"),
    ("my_split_kernel_of_another_library", "other"),
])
def test_kernels_go_to_their_kind(name, kind):
    assert probe.kind(name) == kind


def test_every_forge_kernel_name_is_a_kernel_of_the_package():
    """The profile names a kernel by its function's name, so a renamed kernel (``_total_kernel``
    became ``_norm_kernel``) would fall silently into "other" while its old key stayed here."""
    sources = "\n".join(path.read_text() for path in (Path(__file__).resolve().parents[1] / "kernels").rglob("*.py"))
    missing = [name for name in probe.FORGE_KERNELS if f"def {name}(" not in sources]
    assert not missing, f"probe_model_step.FORGE_KERNELS names no kernel under kernels/: {missing}"
