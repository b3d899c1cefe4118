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
