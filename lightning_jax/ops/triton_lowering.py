"""Every Triton-specific import of the package: the Pallas kernels of each op reach Triton through here only.

Pallas Triton is deprecated since JAX 0.11 but remains the portable path
(sm80-sm120); keeping its imports in one module lets another backend replace it.
"""

from __future__ import annotations

from jax._src import source_info_util
from jax.experimental.pallas import triton as plgpu

# The one traceback of every kernel traced under `one_source_location` (this module's, at import).
_KERNEL_TRACEBACK = source_info_util.current().traceback


def dot(a, b, *, exact, trans_a=False, trans_b=False):
  """a @ b on the matrix units; `exact`: float32 inputs get IEEE float32 products (Triton would use tf32)."""
  return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=False if exact else None)


def compiler_params(*, num_warps: int, num_stages: int):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def one_source_location():
  """A context in which every equation of a kernel carries one traceback, whoever traces it.

  A Triton kernel's serialised IR holds its equations' source locations, and
  JAX traces a custom_vjp's backward under the primal call's traceback: the
  same kernel call on the same operands, issued in a forward and in a backward
  (a sequence split's first pass), would serialise differently and XLA's
  common-subexpression pass would keep both. Triton's errors for such a kernel
  then point here rather than into its body.
  """
  return source_info_util.user_context(_KERNEL_TRACEBACK)
