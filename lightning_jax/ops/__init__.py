"""Ops of lightning_jax, one folder per op."""
