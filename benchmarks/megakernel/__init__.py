"""Probes of a persistent decode kernel (issue 10): ``probe.py`` (one loop's weight stream, ``gemv_chain.cu``)
and ``loop.py`` (the whole loop as rlt-decode's ``persistent_loop`` runs it, against the kernel-per-op graph)."""
