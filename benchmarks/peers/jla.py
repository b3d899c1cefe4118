"""jax-linear-attention (PyPI jax-linear-attention, package `jla`): its Mosaic GPU kernels.

    jla.ops.linear_attention(kind, q, k, v, g=g, impl="mosaic_gpu", scale=...) -> (o, final_state)
    jla.ops.linear_attention(kind, q, k, v, beta=beta[, g=g], impl="mosaic_gpu", scale=...)   # the delta forms

q, k: [B, T, H, K], v: [B, T, H, V] (our layout), bf16/fp16 (KDA: bf16) with
K, V in {64, 128}, on an sm_90 GPU. The lightning op is kind "simple_gla": `g`
is the [B, T, H] natural-log decay of every token, so `g = -decay` (per-head
rates broadcast over B and T; zeros without decay); it is differentiated with
per-token rates only. The delta forms are the kinds of the same names
("deltanet", "gated_deltanet", "kda"): `beta` [B, T, H] and `g = -decay`
([B, T, H], KDA [B, T, H, K]), both differentiated.
Packed rows: `segment_ids` [B, T] (the Mosaic GPU kernels take no
`cu_seqlens`). `impl="mosaic_gpu"`
selects the Pallas Mosaic GPU kernels (registered when `jla.ops.mosaic_gpu`
imports); other impls are "chunked" (plain JAX) and "reference".
Measured with the JAX worker of `benchmarks.jax_impls`; a case the kernels
refuse (their ValueError at tracing: dims, dtype, length) is reported skipped.
"""

from __future__ import annotations

from benchmarks import cases, worker


def _kind(job: dict) -> str:
  return job["decay"] if cases.is_delta(job) else "simple_gla"


def make_attention(job: dict):
  """(attn(q, k, v, *gates[, segment_ids]) -> o, (*gates[, segment_ids])) for one jla job."""
  import jax.numpy as jnp  # noqa: PLC0415
  from jla import ops  # noqa: PLC0415 -- the package is optional

  from benchmarks import jax_impls  # noqa: PLC0415 -- imports JAX

  b, t, h, d, _ = cases.job_shape(job)
  if cases.is_delta(job):
    gates = cases.delta_gates(job)
    inputs = {"beta": jnp.asarray(gates["beta"]), **({"g": -jnp.asarray(gates["decay"])} if "decay" in gates else {})}
  else:
    rates = cases.decay_array(job)
    inputs = {"g": -jnp.broadcast_to(jnp.zeros(h, jnp.float32) if rates is None else rates, (b, t, h))}
  ids = cases.segment_ids(job)
  if ids is not None:
    inputs["segment_ids"] = jnp.asarray(ids)
  kind = _kind(job)
  return jax_impls.bind(lambda q, k, v, **inputs: ops.linear_attention(kind, q, k, v, impl="mosaic_gpu",
                                                                       scale=d ** -0.5, **inputs)[0], inputs)


def unavailable(job: dict) -> str | None:
  import jax  # noqa: PLC0415
  from jla import ops  # noqa: PLC0415

  from benchmarks import jax_impls  # noqa: PLC0415

  if jax.devices()[0].platform != "gpu":
    return "the jla Mosaic GPU kernels need an NVIDIA Hopper GPU"
  if "mosaic_gpu" not in ops.available(_kind(job)):
    return f"jla registered no mosaic_gpu {_kind(job)} kernel (Mosaic GPU missing from this jaxlib)"
  return jax_impls.refusal(job, *make_attention(job))


def make_backend() -> worker.Backend:
  reason = worker.missing_module({"jla.ops": "jax-linear-attention"})
  if reason is not None:
    return worker.Unavailable(reason)
  from benchmarks import jax_impls  # noqa: PLC0415 -- imports JAX

  return jax_impls.JaxBackend(make_attention, unavailable)


if __name__ == "__main__":
  worker.main(make_backend)
