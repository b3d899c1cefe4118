"""Every Triton-specific import of the package: the Pallas kernels of each op reach Triton through here only.

Pallas Triton is deprecated since JAX 0.11 but remains the portable path
(sm80-sm120); keeping its imports in one module lets another backend replace it.
"""

from __future__ import annotations

from jax.experimental.pallas import triton as plgpu


def dot(a, b, *, exact, trans_a=False, trans_b=False):
  """a @ b on the matrix units; `exact`: float32 inputs get IEEE float32 products (Triton would use tf32)."""
  return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=False if exact else None)


def compiler_params(*, num_warps: int, num_stages: int):
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def load_rows(ref, rows, valid):
  """ref[rows, :] of a [T, D] ref; valid: None (every row exists) or [C] bool, the rows inside it (the others read
  as zeros: a chunk that runs past T, unpadded)."""
  if valid is None:
    return ref[rows, :]
  return plgpu.load(ref.at[rows, :], mask=valid[:, None], other=0)


def store_rows(ref, rows, value, valid):
  """ref[rows] = value, of a [T, D] or [T] ref; valid as `load_rows`' (the rows outside it are not written)."""
  if valid is None:
    ref[rows] = value
  else:
    plgpu.store(ref.at[rows], value, mask=valid if ref.ndim == 1 else valid[:, None])
