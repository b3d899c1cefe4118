"""jax-linear-attention (PyPI jax-linear-attention, package `jla`): `simple_gla` on Mosaic GPU.

    jla.ops.linear_attention("simple_gla", q, k, v, g=g, impl="mosaic_gpu", scale=...) -> (o, final_state)

q, k: [B, T, H, K], v: [B, T, H, V] (our layout), bf16/fp16 with K, V in
{64, 128}, on an sm_90 GPU. `g` is the [B, T, H] natural-log decay of every
token, so `g = -decay` (per-head rates broadcast over B and T; zeros without
decay); it is an argument of the compiled functions, not differentiated.
Packed rows: `segment_ids` [B, T] (the Mosaic GPU kernels take no
`cu_seqlens`). `impl="mosaic_gpu"`
selects the Pallas Mosaic GPU kernels (registered when `jla.ops.mosaic_gpu`
imports); other impls are "chunked" (plain JAX) and "reference".
Measured with the JAX worker of `benchmarks.jax_impls`.
"""

from __future__ import annotations

from benchmarks import cases, worker


def make_attention(job: dict):
  """(attn(q, k, v, g[, segment_ids]) -> o, (g[, segment_ids])) for one jla job."""
  import jax.numpy as jnp  # noqa: PLC0415
  from jla import ops  # noqa: PLC0415 -- the package is optional

  from benchmarks import jax_impls  # noqa: PLC0415 -- imports JAX

  b, t, h, d, _ = cases.job_shape(job)
  rates = cases.decay_array(job)
  inputs = {"g": -jnp.broadcast_to(jnp.zeros(h, jnp.float32) if rates is None else rates, (b, t, h))}
  ids = cases.segment_ids(job)
  if ids is not None:
    inputs["segment_ids"] = jnp.asarray(ids)
  return jax_impls.bind(lambda q, k, v, **inputs: ops.linear_attention("simple_gla", q, k, v, impl="mosaic_gpu",
                                                                       scale=d ** -0.5, **inputs)[0], inputs)


def unavailable(job: dict) -> str | None:
  import jax  # noqa: PLC0415
  from jla import ops  # noqa: PLC0415

  del job
  if jax.devices()[0].platform != "gpu":
    return "the jla Mosaic GPU kernels need an NVIDIA Hopper GPU"
  if "mosaic_gpu" not in ops.available("simple_gla"):
    return "jla registered no mosaic_gpu simple_gla kernel (Mosaic GPU missing from this jaxlib)"
  return None


def make_backend() -> worker.Backend:
  reason = worker.missing_module({"jla.ops": "jax-linear-attention"})
  if reason is not None:
    return worker.Unavailable(reason)
  from benchmarks import jax_impls  # noqa: PLC0415 -- imports JAX

  return jax_impls.JaxBackend(make_attention, unavailable)


if __name__ == "__main__":
  worker.main(make_backend)
