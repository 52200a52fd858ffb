"""Probes of a persistent decode kernel (issue 10): see probe.py."""
