"""Attention backends. Each module is one backend; GPU ones import their kernels lazily."""
