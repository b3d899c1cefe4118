"""Times what one device of sequence parallelism runs, on one device, against the plain op.

    python -m benchmarks.sequence_pieces [--shape 1x131072x32x128] [--states-blocks 64x64x4x3,128x128x8x2]

A device of `sequence_axis` runs, per local slice of T (`sequence_parallel`):
forward, the slice's own state (a states pass over k, v) then the op from its
prefix state; forward+backward, also a reverse states pass over q, do and the
op's backward from a final-state cotangent. This times each of those programs
(bf16, the fixed ALiBi rates, impl="pallas", the VJP with respect to q, k, v)
beside the plain op's forward and forward+backward, so that the sums

    forward:          states + prefix_fwd
    forward+backward: states + states_reverse + prefix_fwdbwd

give the device's compute before any exchange (the all-gathers move [B, H, D,
E] float32 states). The states passes are timed with each block config of
`--states-blocks` (block_d x block_e x warps x stages of `ChunkStatesConfig`;
"default" is the heuristics' choice).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import lightning_jax as lj
from lightning_jax.ops.lightning_attention import api
from lightning_jax.ops.lightning_attention import heuristics
from lightning_jax.ops.lightning_attention.config import ChunkStatesConfig
from lightning_jax.ops.lightning_attention.config import LightningConfig
from lightning_jax.tune import timing


def _inputs(shape, seed):
  b, t, h, d = shape
  keys = jax.random.split(jax.random.key(seed), 6)
  q, k, v, do = (jax.random.normal(key, (b, t, h, d), jnp.bfloat16) for key in keys[:4])
  prefix, d_final = (jax.random.normal(key, (b, h, d, d), jnp.float32) for key in keys[4:])
  return q, k, v, do, prefix, d_final


def _states_config(text):
  if text == "default":
    return None
  bd, be, warps, stages = (int(x) for x in text.split("x"))
  return LightningConfig(chunk_states=ChunkStatesConfig(block_d=bd, block_e=be, num_warps=warps, num_stages=stages))


def programs(decay, states_blocks):
  """{name: fn(q, k, v, do, prefix, d_final)}: the plain op's and one sequence-parallel device's programs."""
  def op(q, k, v, **kwargs):
    return lj.lightning_attention(q, k, v, decay, impl="pallas", **kwargs)

  def fwdbwd(q, k, v, do, cotangents=None, **kwargs):
    o, vjp = jax.vjp(lambda q, k, v: op(q, k, v, **kwargs), q, k, v)
    return o, vjp(do if cotangents is None else cotangents)

  def states(y, z, blocks, reverse):
    device = heuristics.device_of(y)
    interpret = api.pallas_interpret(None, heuristics.compute_capability(device), y)
    return api._slice_state(y, z, decay, None, reverse, scale=float(y.shape[-1] ** -0.5), impl="pallas",  # noqa: SLF001
                            config=_states_config(blocks), interpret=interpret, device=device)

  found = {
      "fwd": lambda q, k, v, do, prefix, d_final: op(q, k, v),
      "fwdbwd": lambda q, k, v, do, prefix, d_final: fwdbwd(q, k, v, do),
      "prefix_fwd": lambda q, k, v, do, prefix, d_final: op(q, k, v, initial_state=prefix, return_final_state=True),
      "prefix_fwdbwd": lambda q, k, v, do, prefix, d_final: fwdbwd(
          q, k, v, None, (do, d_final), initial_state=prefix, return_final_state=True),
  }
  for blocks in states_blocks:
    found[f"states[{blocks}]"] = lambda q, k, v, do, prefix, d_final, b=blocks: states(k, v, b, False)
    found[f"states_reverse[{blocks}]"] = lambda q, k, v, do, prefix, d_final, b=blocks: states(q, do, b, True)
  return found


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shape", default="1x131072x32x128", help="one device's BxTxHxD")
  p.add_argument("--states-blocks", default="default", help="comma-separated default or DxExWARPSxSTAGES")
  args = p.parse_args(argv)
  shape = tuple(int(x) for x in args.shape.split("x"))
  decay = jnp.asarray(lj.alibi_slopes(shape[2]))
  arg_sets = [_inputs(shape, seed) for seed in range(2)]
  times = {}
  for name, fn in programs(decay, args.states_blocks.split(",")).items():
    compiled = jax.jit(fn).lower(*arg_sets[0]).compile()
    times[name] = timing.measure(lambda i, c=compiled: c(*arg_sets[i]), jax.block_until_ready, n_sets=2, warmup=2,
                                 max_iters=15, max_seconds=0.5, min_sample_seconds=timing.GPU_SAMPLE_SECONDS)["time_ms"]
    print(f"{args.shape} {name:32s} {times[name]:8.3f} ms", flush=True)
  best = lambda prefix: min(ms for name, ms in times.items() if name.startswith(prefix + "["))  # noqa: E731
  fwd = best("states") + times["prefix_fwd"]
  fwdbwd = best("states") + best("states_reverse") + times["prefix_fwdbwd"]
  print(f"one device of sequence parallelism (best states blocks): forward {fwd:.3f} ms "
        f"({fwd / times['fwd']:.2f}x the plain op), forward+backward {fwdbwd:.3f} ms "
        f"({fwdbwd / times['fwdbwd']:.2f}x)")
  return times


if __name__ == "__main__":
  main()
