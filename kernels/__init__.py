"""Triton kernels for hf_kvint2 (installed as ``hf_kvint2.kernels``)."""
