"""Shared test fixtures and settings: kernel execution modes (interpret on any backend, compiled on a GPU)."""

import os

# XLA may otherwise drop f32 -> bf16 -> f32 round trips, so that interpret mode
# on the CPU computes more precisely than the GPU does and hides rounding bugs;
# eight host devices make the CPU mesh of the multi-device tests; XLA:CPU's
# YNNPACK fusions off: with jaxlib 0.10.2 on an AMD EPYC (no AVX-512) an
# elementwise one took an operand in a transposed layout and segfaulted (the
# KDA layer's gradient; with only elementwise fusions on, XLA names the layout).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false"
                           " --xla_force_host_platform_device_count=8 --xla_cpu_experimental_ynn_fusion_type=").strip()


def _jaxlib_version():
  from importlib import metadata  # noqa: PLC0415

  try:
    return tuple(int(part) for part in metadata.version("jaxlib").split(".")[:2])
  except (metadata.PackageNotFoundError, ValueError):
    return None


# XLA:CPU's older (LLVM IR) fusion emitters instead of its MLIR ones, where
# jaxlib still has the switch (0.10; 0.11 removed it, and XLA aborts on an
# unknown flag): they compile this suite's programs (interpret-mode kernels,
# oracles, their gradients; each run once or twice on tiny shapes) 2-3x faster,
# and compiling is most of the suite's time. Both emit the same HLO's
# arithmetic in float32; the kernels themselves are compiled by Triton on a GPU.
# XLA_FLAGS=--xla_cpu_use_fusion_emitters=true compiles as a user would.
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"] and (_jaxlib_version() or (0, 11)) < (0, 11):
  os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# Test processes (pytest-xdist runs several) allocate GPU memory as they go
# instead of each reserving 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest  # noqa: E402
from helpers import GPU_ONLY, gpu_available  # noqa: E402


@pytest.fixture(scope="module")
def unoptimized_compiles():
  """Compiles the module's programs without LLVM's optimisations (on the CPU).

  Most of the time of the kernel tests is XLA compiling interpret-mode kernels,
  oracles and their gradients, each for a single run; LLVM's optimisation of
  the generated code is half of that. XLA's own passes, which decide what is
  fused and where values are rounded, still run. The float32 results move by a
  few ulps, so the modules that take this compare with tolerances well above
  float32 rounding (`pytestmark = pytest.mark.usefixtures("unoptimized_compiles")`).
  JAX_DISABLE_MOST_OPTIMIZATIONS=0 compiles as a user would; a GPU always does.
  """
  if "JAX_DISABLE_MOST_OPTIMIZATIONS" in os.environ or gpu_available():
    yield
    return
  jax.config.update("jax_disable_most_optimizations", True)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", False)


# Every kernel case runs twice: through Pallas interpret mode (CPU CI) and
# compiled through Triton when an NVIDIA GPU (sm80+) is present.
KERNEL_MODES = [pytest.param("interpret", id="interpret"), pytest.param("gpu", id="gpu", marks=GPU_ONLY)]


@pytest.fixture(params=KERNEL_MODES)
def kernel_mode(request):
  """Returns the `interpret=` argument of the mode."""
  return request.param == "interpret"


# --- the compatibility tier (`-m compat`) ---------------------------------------------
#
# .ci/run's run on the newest JAX (Python 3.12, jax 0.12.x): after the full suite
# has passed on the oldest supported JAX, it checks that every public entry point
# and every kernel path still traces, lowers (interpret mode) and computes the
# right thing on the newest one; the full matrix of shapes and dtypes ran on the
# oldest (and test_warp_specialized.py runs whole on jax 0.11 after it). At least
# one test, forward and backward, of: lightning_attention's Pallas variants
# (chunk_loop, parallel, the sequence split, warp_specialized) and impl="xla",
# per-head, per-token and no decay, packed rows (segment_ids, cu_seqlens);
# delta_attention (DeltaNet, Gated DeltaNet, KDA; xla and Pallas); the Flax
# layers (NNX, Linen, the delta layers, attention_fn, interop's numpy paths);
# sharding (sequence parallelism, the sharded wrapper, Auto and Explicit
# meshes); configs, tuning cache, tune, structure. Each entry is a node id
# prefix; one that matches none of its file's collected tests fails the run.
COMPAT = [
    # lightning_attention: both Pallas variants and xla, forward and every gradient, per-head decay, odd dims
    "tests/test_ops.py::test_pallas_matches_oracle[interpret-B2T17H3D48E80-",
    "tests/test_ops.py::test_pallas_matches_oracle[interpret-B3T64H1D80E48-",  # no decay, float16
    "tests/test_ops.py::test_xla_matches_oracle[B2T17H3D48E80-",
    "tests/test_ops.py::test_gradient_subsets[interpret-decay-",
    "tests/test_ops.py::test_backward_runs_only_the_sweeps_it_needs",
    "tests/test_ops.py::test_final_states_written_only_when_read",
    "tests/test_ops.py::test_reference_by_hand",
    # packed rows and per-token decay: every Pallas variant, xla, the oracle
    "tests/test_packed.py::test_pallas_packed_matches_sequences_alone[interpret-seg[[64, 1, 50, 35], [20, 44, 86]]",
    "tests/test_packed.py::test_pallas_packed_matches_sequences_alone[interpret-cu[[0, 30, 99, 0]]H1D40E8-bfloat16-"
    "decay_None-s0_1-chunk_loop]",
    "tests/test_packed.py::test_xla_packed_matches_sequences_alone[cu[[1, 0, 63, 64, 0, 17, 1]]",
    "tests/test_packed.py::test_reference_packed_matches_sequences_alone[seg[[100, 48]]",
    "tests/test_packed.py::test_bad_packing_input_is_rejected",
    "tests/test_packed.py::test_segment_ids_from_cu_seqlens",
    # the sequence split (Triton states pass), its handed-over backward passes, warp-specialised included
    "tests/test_sequence_split.py::test_split_chunk_loop_matches_oracle[interpret-B1T300H2D16E16-",
    "tests/test_sequence_split.py::test_split_backward_takes_the_forwards_pass",
    "tests/test_sequence_split.py::test_split_backward_from_handed_over_passes_matches_oracle",
    "tests/test_sequence_split.py::test_auto_splits_few_long_sequences_only",
    # warp_specialized: the kernel in the Mosaic GPU interpreter, packed and per-token, its CUDA lowering
    "tests/test_warp_specialized.py::test_warp_specialized_matches_oracle[B1T77H3D64E64-",
    "tests/test_warp_specialized.py::test_warp_specialized_matches_oracle[B2T128H2D40E72-",
    "tests/test_warp_specialized.py::test_warp_specialized_packed_matches_sequences_alone[seg[[64, 1, 50, 35]",
    "tests/test_warp_specialized.py::test_warp_specialized_lowers_for_cuda",
    "tests/test_warp_specialized.py::test_warp_specialized_rejects_what_it_cannot_run",
    "tests/test_warp_specialized.py::test_warp_specialized_config_is_validated_and_budgeted",
    "tests/test_warp_specialized.py::test_auto_picks_warp_specialized_where_it_was_measured_faster",
    # and its delta mode: the forward interpreted (Gated DeltaNet, packed), lowered, refused
    "tests/test_warp_specialized.py::test_delta_warp_specialized_matches_oracle[B2T150H2D64E48-",
    "tests/test_warp_specialized.py::test_delta_warp_specialized_lowers_for_cuda",
    "tests/test_warp_specialized.py::test_delta_warp_specialized_is_budgeted_and_refuses_what_it_cannot_run",
    # KDA's: its chunk terms' kernel lowered, the forward on them interpreted (near the fast path's bound)
    "tests/test_warp_specialized.py::test_delta_kda_kernels_lower_for_cuda",
    "tests/test_warp_specialized.py::test_delta_kda_warp_specialized_matches_oracle[B1T200H2D40E72-",
    # delta_attention: the three forms, xla and Pallas, forward and backward
    "tests/test_delta_ops.py::test_oracle_matches_float64_loop",
    "tests/test_delta_ops.py::test_chunked_matches_oracle[B2T45H2D9E7-",
    "tests/test_delta_ops.py::test_chunked_matches_oracle[B2T77H2D16E24-",
    "tests/test_delta_ops.py::test_pallas_matches_oracle[interpret-B2T77H2D9E20-",
    "tests/test_delta_ops.py::test_pallas_matches_oracle[interpret-B2T130H2D16E24-",
    "tests/test_delta_ops.py::test_pallas_gradients[interpret-B2T40H2D8E16-",  # KDA, packed
    "tests/test_delta_ops.py::test_pallas_gradients[interpret-B2T75H2D20E9-",  # Gated DeltaNet
    "tests/test_delta_ops.py::test_pallas_gradients[interpret-B1T33H2D16E16-",  # DeltaNet, packed
    "tests/test_delta_ops.py::test_sequence_split_matches_oracle[interpret-B1T150H2D8E12-",
    "tests/test_delta_ops.py::test_cu_seqlens_states_chunked_matches_oracle[channel]",
    "tests/test_delta_ops.py::test_bad_input_errors",
    # composition with transforms, configs, inputs
    "tests/test_api.py",
    "tests/test_slopes.py",
    "tests/test_structure.py",
    "tests/test_tuning_cache.py",
    "tests/test_tune.py::test_tune_smoke",
    # layers
    "tests/test_layers.py::test_layer_matches_reference",
    "tests/test_layers.py::test_pallas_passthrough",
    "tests/test_layers.py::test_gradients_reach_every_parameter[nnx-learnable]",
    "tests/test_layers.py::test_nnx_decode_matches_full_forward[alibi-bfloat16]",
    "tests/test_layers.py::test_linen_decode_matches_full_forward[minimax]",
    "tests/test_layers.py::test_nnx_jit_train_step_reduces_loss",
    "tests/test_layers_packed.py::test_packed_equals_segments_alone[nnx]",
    "tests/test_layers_packed.py::test_decode_after_packed_prefill[linen]",
    "tests/test_delta_layers.py::test_layer_matches_reference",
    "tests/test_delta_layers.py::test_gradients_reach_every_parameter[nnx-kda-float32]",
    "tests/test_delta_layers.py::test_nnx_decode_matches_full_forward[kda-",
    "tests/test_delta_layers.py::test_packed_equals_segments_alone[linen-scalar]",
    "tests/test_attention_fn.py::test_nnx_multihead_attention",
    "tests/test_attention_fn.py::test_linen_multihead_dot_product_attention",
    "tests/test_attention_fn.py::test_pallas_passthrough",
    "tests/test_attention_fn.py::test_jit_and_grad_through_nnx_mha",
    "tests/test_interop.py::test_round_trip_of_numpy_state_dicts",
    "tests/test_interop.py::test_kimi_checkpoint_names_load_the_same_layer",
    # several devices
    "tests/test_sharding.py::test_sequence_parallel_equals_one_device[4-21-token-True-pallas-False]",
    "tests/test_sharding.py::test_sequence_parallel_equals_one_device[2-21-head-False-xla-True]",
    "tests/test_sharding.py::test_sequence_parallel_differentiates_any_subset[argnums7-xla-final]",
    "tests/test_sharding.py::test_sequence_parallel_runs_the_local_ops_kernels_and_two_states_passes",
    "tests/test_sharding.py::test_sharded_wrapper_equals_one_device[token]",
    "tests/test_sharding.py::test_explicitly_sharded_inputs_split_the_plain_op[batch-heads]",
    "tests/test_sharding.py::test_auto_mesh_sharded_inputs_split_the_plain_op[pallas-head]",
    "tests/test_sharding.py::test_layers_on_a_mesh_equal_one_device[nnx_mesh]",
    "tests/test_sharding.py::test_errors_name_the_argument",
    "tests/test_delta_sharding.py::test_auto_mesh_inputs_stay_on_their_devices[pallas-kda-None]",
    "tests/test_delta_sharding.py::test_auto_mesh_inputs_stay_on_their_devices[pallas-gated_deltanet-2]",
    "tests/test_delta_sharding.py::test_explicit_mesh_splits_the_op[batch-heads]",
    "tests/test_delta_sharding.py::test_sequence_axis_runs_each_slice_from_the_state_before_it[xla-kda-True]",
    "tests/test_delta_sharding.py::test_layers_with_sequence_axis_equal_one_device[nnx]",
    "tests/test_delta_sharding.py::test_sharded_wrapper_equals_the_oracle[kda]",
    "tests/test_delta_sharding.py::test_layers_on_a_mesh_equal_one_device[linen]",
]


# --- the quick GPU tier (`-m gpu_quick`) ------------------------------------------------
#
# On a lent GPU, whose device time comes in minutes: one compiled test of each
# kernel path, forward and backward, so that a kernel change is checked on the
# GPU in one short call (the whole compiled suite, `-k gpu`, is about 280 tests;
# its 95 delta tests alone ran 330 s on an H200 without finishing). On an H200
# (2026-11-30, 6 workers) the tier took 98 s: give it 4 minutes. Full node ids of
# the gpu cases (their interpreted twins share every prefix shorter than the
# id). The rest of `-k gpu` still runs before a kernel's work is called done.
GPU_QUICK = [
    # lightning_attention's Triton kernels: chunk_loop and parallel, gradients (decay's too), packed per-token rows
    # (segment ids through the sequence split, cu_seqlens through chunk_loop), the split
    "tests/test_ops.py::test_pallas_matches_oracle[gpu-B2T65H3D128E16-bfloat16-decay_random-s0_1-scale_0.3-final_1-"
    "chunk_loop]",
    "tests/test_ops.py::test_pallas_matches_oracle[gpu-B2T65H3D128E16-bfloat16-decay_random-s0_1-scale_0.3-final_1-"
    "parallel]",
    "tests/test_ops.py::test_gradient_subsets[gpu-q+k+v-chunk_loop]",
    "tests/test_ops.py::test_gradient_subsets[gpu-decay-parallel]",
    "tests/test_packed.py::test_pallas_packed_matches_sequences_alone[gpu-seg[[64, 1, 50, 35], [20, 44, 86]]H2D24E40-"
    "float32-decay_token-s0_1-split]",
    "tests/test_packed.py::test_pallas_packed_matches_sequences_alone[gpu-cu[[1, 0, 63, 64, 0, 17, 1]]H2D16E24-float32-"
    "decay_token-s0_1-chunk_loop]",
    "tests/test_sequence_split.py::test_split_chunk_loop_matches_oracle[gpu-B1T130H2D128E128-bfloat16-decay_random-"
    "s0_1-"
    "scale_None-final_1-64]",
    # the warp-specialised forward (sm90): per-head rates, packed per-token rows, the split on it (and on a packed row
    # with a per-head rate: the states pass's segment counts built beside the kernel's)
    "tests/test_warp_specialized.py::test_warp_specialized_matches_oracle[B2T300H3D128E96-bfloat16-decay_random-s0_1-"
    "scale_None-final_1-gpu]",
    "tests/test_warp_specialized.py::test_warp_specialized_packed_matches_sequences_alone[seg[[64, 1, 50, 35], "
    "[20, 44, 86]]H2D64E48-bfloat16-decay_token-s0_1-gpu]",
    "tests/test_warp_specialized.py::test_warp_specialized_split_packed_row_matches_sequences_alone[seg[[100, 48, 130]]"
    "H2D64E48-bfloat16-decay_head-s0_1-gpu]",
    "tests/test_sequence_split.py::test_split_warp_specialized_matches_oracle[B1T300H2D64E64-bfloat16-decay_random-"
    "s0_1-"
    "scale_None-final_1-128-gpu]",
    # delta_attention's Triton kernels: KDA packed forward and gradients, Gated DeltaNet's gradients, cu_seqlens with
    # per-sequence states
    "tests/test_delta_ops.py::test_pallas_matches_oracle[gpu-B2T130H2D16E24-decay_channel-moderate-beta_uniform-seg1-"
    "s0_1]",
    "tests/test_delta_ops.py::test_pallas_gradients[gpu-B2T40H2D8E16-decay_channel-moderate-beta_uniform-seg1-s0_1]",
    "tests/test_delta_ops.py::test_pallas_gradients[gpu-B2T75H2D20E9-decay_token-moderate-beta_uniform-seg0-s0_0]",
    "tests/test_delta_ops.py::test_cu_seqlens_states_pallas_matches_oracle[gpu-token-bfloat16-both]",
    # and on sm90: the inverse, the forward, the backward (Gated DeltaNet packed; DeltaNet in float16), KDA's forward
    # (packed, 2 pieces) and backward, the split
    "tests/test_warp_specialized.py::test_delta_inverse_matches_float64[B2T100H2D64E7-decay_token-extreme-beta_edges-"
    "seg0-"
    "s0_1-bfloat16-gpu]",
    "tests/test_warp_specialized.py::test_delta_warp_specialized_matches_oracle[B2T300H3D128E100-decay_token-moderate-"
    "beta_uniform-seg1-s0_1-gpu]",
    "tests/test_warp_specialized.py::test_delta_warp_specialized_gradients_match_oracle[B2T150H2D64E48-decay_token-"
    "moderate-beta_uniform-seg1-s0_1-gpu]",
    "tests/test_warp_specialized.py::test_delta_warp_specialized_gradients_match_oracle[B1T136H2D40E64-decay_None-"
    "moderate-beta_uniform-seg0-s0_0-f16-gpu]",
    "tests/test_warp_specialized.py::test_delta_kda_warp_specialized_matches_oracle[B1T150H1D64E48-decay_channel-"
    "moderate-beta_uniform-seg1-s0_1-(0.0, 0.6)-2-gpu]",
    "tests/test_warp_specialized.py::test_delta_kda_backward_on_chunk_terms[B2T300H3D128E100-decay_channel-moderate-"
    "beta_uniform-seg0-s0_1-(0.0, 0.6)-gpu]",
    "tests/test_warp_specialized.py::test_delta_sequence_split_matches_oracle[300-gpu]",
    "tests/test_warp_specialized.py::test_delta_sequence_split_matches_oracle[288-gpu]",
]

TIERS = {"compat": COMPAT, "gpu_quick": GPU_QUICK}


def pytest_collection_modifyitems(config, items):
  """Marks the COMPAT tests `compat` and the GPU_QUICK ones `gpu_quick`; an entry that matches none of its file's
  collected tests is an error."""
  files = {item.nodeid.split("::")[0] for item in items}
  matched = set()
  for item in items:
    for marker, prefixes in TIERS.items():
      for prefix in prefixes:
        if item.nodeid.startswith(prefix):
          item.add_marker(getattr(pytest.mark, marker))
          matched.add(prefix)
  # Only where the whole file was collected (a -k or a node id narrows it).
  if not config.option.keyword and not any("::" in str(arg) for arg in config.args):
    stale = [p for prefixes in TIERS.values() for p in prefixes if p.split("::")[0] in files and p not in matched]
    if stale:
      raise pytest.UsageError(f"tests/conftest.py COMPAT or GPU_QUICK entries that match no test: {stale}")
