"""Shared test fixtures: kernel execution modes (interpret on any backend, compiled on a GPU)."""

import os

# XLA may otherwise drop f32 -> bf16 -> f32 round trips, so that interpret mode
# on the CPU computes more precisely than the GPU does and hides rounding bugs.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_allow_excess_precision=false").strip()
# Test processes (pytest-xdist runs several) allocate GPU memory as they go
# instead of each reserving 75% of it up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import pytest  # noqa: E402
from helpers import GPU_ONLY  # noqa: E402

# Every kernel case runs twice: through Pallas interpret mode (CPU CI) and
# compiled through Triton when an NVIDIA GPU (sm80+) is present.
KERNEL_MODES = [pytest.param("interpret", id="interpret"), pytest.param("gpu", id="gpu", marks=GPU_ONLY)]


@pytest.fixture(params=KERNEL_MODES)
def kernel_mode(request):
  """Returns the `interpret=` argument of the mode."""
  return request.param == "interpret"
