"""Benchmark suite of lightning_jax: `python -m benchmarks.run --help`.

The parent process (`benchmarks.run`) imports neither JAX nor torch: every
implementation family is measured in its own subprocess (`benchmarks.jax_impls`,
`benchmarks.peers.*`), so that a missing package, a crash or a torch/JAX memory
clash cannot break the run.
"""
