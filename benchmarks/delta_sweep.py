"""Times the delta attention kernels one by one, and the op, under several `DeltaConfig`s.

    python -m benchmarks.delta_sweep --out delta-sweep.json [--shapes 2x8192x32x128] [--forms deltanet,kda]

For each shape (bf16), form (DeltaNet, Gated DeltaNet, KDA) and config, it
compiles and times each Pallas kernel of `pallas_triton` on its own (prepare,
the forward sweep, the backward's state sweep, state_cotangents, and
chunk_gradients: the per-chunk gradient kernel, by tiles or not; each row also
runs what feeds that kernel: the gates' jnp and, for the sweeps, prepare) and
the op through `delta_attention` (forward, and forward plus backward of every
input), and prints one JSON row per timing. Configs are
`name=field:value,...` over `DeltaConfig`'s fields, ';'-separated; `default`
is `default_config`'s. PERFORMANCE.md ("Delta attention") cites its runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp

import lightning_jax as lj
from lightning_jax.ops.delta_attention import api as delta_api
from lightning_jax.ops.delta_attention import pallas_triton as pt
from lightning_jax.ops.lightning_attention import chunk_common
from lightning_jax.ops.lightning_attention import config as lightning_config
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.tune import timing

FORMS = ("deltanet", "gated_deltanet", "kda")
KERNELS = ("prepare", "sweep", "state_sweep", "state_cotangents", "chunk_gradients", "op_fwd", "op_fwdbwd")


def _inputs(key, b, t, h, d, form):
  kq, kk, kv, kb, kg, kd = jax.random.split(key, 6)
  q = delta_api.l2_normalize(jax.random.normal(kq, (b, t, h, d), jnp.bfloat16))
  k = delta_api.l2_normalize(jax.random.normal(kk, (b, t, h, d), jnp.bfloat16))
  v = jax.random.normal(kv, (b, t, h, d), jnp.bfloat16)
  beta = jax.nn.sigmoid(jax.random.normal(kb, (b, t, h), jnp.float32))
  decay = {"deltanet": None, "gated_deltanet": jax.random.uniform(kg, (b, t, h), jnp.float32, 0.001, 0.2),
           "kda": jax.random.uniform(kg, (b, t, h, d), jnp.float32, 0.001, 0.2)}[form]
  do = jax.random.normal(kd, (b, t, h, d), jnp.bfloat16)
  return q, k, v, beta, decay, do


def _kernel_fns(config, scale, dp):
  """name -> f(q, k, v, beta, decay, do, states) running that kernel alone on the padded operands (the gates too).

  states: None, or for chunk_gradients its per-chunk state operands (`_states`), made outside the timed call.
  """
  kw = dict(scale=scale, config=config, interpret=jax.default_backend() != "gpu")
  bwd = dict(kw, config=dataclasses.replace(config, chunk_size=config.backward_chunk_size, prepare_warps=None))

  def operands(q, k, v, beta, decay, chunk_size):
    g = pt.gate_logs(decay, seq_len=q.shape[1], dim_k=dp, chunk_size=chunk_size)
    return pt.padded_operands(q, k, v, beta, None, g, chunk_size=chunk_size)

  def prepare(q, k, v, beta, decay, do, states):
    qp, kp, vp, br, gates = operands(q, k, v, beta, decay, config.chunk_size)
    return pt.prepare(qp, kp, vp, br, gates, **kw)[:3]

  def sweep(q, k, v, beta, decay, do, states):
    qp, kp, vp, br, gates = operands(q, k, v, beta, decay, config.chunk_size)
    w, u, p, _ = pt.prepare(qp, kp, vp, br, gates, **kw)
    return pt.sweep(qp, kp, w, u, p, gates, None, with_final_state=False, **kw)

  def state_sweep(q, k, v, beta, decay, do, states):
    qp, kp, vp, br, gates = operands(q, k, v, beta, decay, config.backward_chunk_size)
    w, u, p, _ = pt.prepare(qp, kp, vp, br, gates, **bwd)
    return pt.sweep(qp, kp, w, u, p, gates, None, with_outputs=False, with_final_state=False, with_states=True,
                    **bwd)

  def state_cotangents(q, k, v, beta, decay, do, states):
    qp, kp, vp, br, gates = operands(q, k, v, beta, decay, config.backward_chunk_size)
    w, u, p, _ = pt.prepare(qp, kp, vp, br, gates, **bwd)
    dop = chunk_common.pad_tokens_and_features(do, num_tokens=qp.shape[1], dim=vp.shape[-1])
    return pt.state_cotangents(qp, kp, w, p, gates, dop, None, **bwd)

  def chunk_gradients(q, k, v, beta, decay, do, states):
    qp, kp, vp, br, gates = operands(q, k, v, beta, decay, config.backward_chunk_size)
    dop = chunk_common.pad_tokens_and_features(do, num_tokens=qp.shape[1], dim=vp.shape[-1])
    if not config.splits_backward(per_channel_gate=decay is not None and decay.ndim == 4):
      return pt.chunk_gradients(qp, kp, vp, br, gates, states, states, dop, **bwd)
    # The tile kernel, on stand-ins of the same shapes for T, U and dU.
    b, tp, h, _ = qp.shape
    tri = jnp.zeros((b, h, tp, config.backward_chunk_size), qp.dtype)
    return pt.tile_gradients(qp, kp, vp, br, gates, tri, states, states, vp, dop, dop, **bwd)

  def op_fwd(q, k, v, beta, decay, do, states):
    return lj.delta_attention(q, k, v, beta, decay, impl="pallas", config=config)

  def op_fwdbwd(q, k, v, beta, decay, do, states):
    args = (q, k, v, beta) if decay is None else (q, k, v, beta, decay)
    o, vjp = jax.vjp(lambda *a: lj.delta_attention(*a, impl="pallas", config=config), *args)
    return o, vjp(do)

  return dict(prepare=prepare, sweep=sweep, state_sweep=state_sweep, state_cotangents=state_cotangents,
              chunk_gradients=chunk_gradients, op_fwd=op_fwd, op_fwdbwd=op_fwdbwd)


def _states(key, q, config):
  """Random per-chunk states [B, H, N Dp, Ep] in q's dtype, the chunk gradients' S_n and G_n operands."""
  b, t, h, d = q.shape
  n = -(-t // config.backward_chunk_size)
  dp = lightning_config.padded_dim(d)
  return 0.1 * jax.random.normal(key, (b, h, n * dp, dp), q.dtype)


def config_value(text):
  """A `DeltaConfig` field's value from the command line: true, false or an int."""
  return text == "true" if text in ("true", "false") else int(text)


def _parse_configs(text):
  configs = []
  for item in text.split(";"):
    name, _, fields = item.partition("=")
    configs.append((name, {f: config_value(x) for f, x in (kv.split(":") for kv in fields.split(",") if kv)}))
  return configs


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default="2x8192x32x128,4x8192x32x64", help="BxTxHxD (D = E), comma-separated")
  p.add_argument("--forms", default=",".join(FORMS))
  p.add_argument("--kernels", default=",".join(KERNELS))
  p.add_argument("--configs", default="default=", help="name=field:value,...; ';'-separated")
  p.add_argument("--out", help="write the rows as JSON here (after every shape and form)")
  p.add_argument("--compile-threads", type=int, default=12)
  p.add_argument("--max-seconds", type=float, default=0.3, help="per timing")
  args = p.parse_args(argv)
  device = jax.devices()[0]
  cc, num_sms = heuristics.compute_capability(device), heuristics.num_sms(device)
  rows = []
  for shape in args.shapes.split(","):
    b, t, h, d = (int(x) for x in shape.split("x"))
    dp = lightning_config.padded_dim(d)
    for form in args.forms.split(","):
      sets = [_inputs(jax.random.PRNGKey(s), b, t, h, d, form) for s in range(2)]
      base = pt.default_config(per_channel_gate=form == "kda", dtype=jnp.bfloat16, dim_k=d, compute_capability=cc,
                               batch_heads=b * h, num_sms=num_sms)
      jobs, states = [], {}  # states: per backward chunk size, one array per input set
      for name, fields in _parse_configs(args.configs):
        try:
          config = dataclasses.replace(base, **fields)
        except ValueError as e:
          print(json.dumps(dict(form=form, config=name, error=str(e))))
          continue
        fns = _kernel_fns(config, d ** -0.5, dp)
        for kernel in args.kernels.split(","):
          extra = [None] * len(sets)
          if kernel == "chunk_gradients":
            extra = states.setdefault(config.backward_chunk_size, [
                _states(jax.random.PRNGKey(100 + i), s[0], config) for i, s in enumerate(sets)])
          jobs.append((name, config, kernel, fns[kernel], [(*s, x) for s, x in zip(sets, extra)]))

      def build(job):
        try:
          return jax.jit(job[3]).lower(*job[4][0]).compile()
        except Exception as e:  # noqa: BLE001  a config over the device's budget: recorded, not fatal
          return f"{type(e).__name__}: {str(e)[:300]}"

      with concurrent.futures.ThreadPoolExecutor(args.compile_threads) as pool:
        compiled = list(pool.map(build, jobs))
      for (name, config, kernel, _, job_sets), fn in zip(jobs, compiled):
        row = dict(shape=[b, t, h, d], form=form, config=name, kernel=kernel, fields=dataclasses.asdict(config))
        if isinstance(fn, str):
          row["error"] = fn
        else:
          call = functools.partial(lambda f, job_sets, i: f(*job_sets[i]), fn, job_sets)
          row["median_ms"] = timing.measure(call, jax.block_until_ready, n_sets=len(job_sets), warmup=2, max_iters=20,
                                            max_seconds=args.max_seconds,
                                            min_sample_seconds=timing.GPU_SAMPLE_SECONDS)["time_ms"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "fields"}), flush=True)
      if args.out:
        with open(args.out, "w") as f:
          json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
