"""rlt.serve — OpenAI-compatible HTTP serving for rlt (FastAPI + uvicorn).

Modules: ``feature`` (the ``http`` Feature and its options; light, loaded by every CLI run),
``protocol`` (request bodies), ``errors`` (OpenAI-shaped errors), ``async_engine`` (the engine
thread and its asyncio front end), ``serving`` (requests -> engine -> responses / SSE),
``routes``, ``metrics`` (Prometheus), ``limits`` (body size), ``info`` (what /v1/engine serves),
``state``, ``app`` and ``server`` (uvicorn, graceful shutdown).

Nothing is imported here, so that loading the feature entry point stays cheap.
"""
