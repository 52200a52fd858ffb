"""Model families rlt serves, keyed by ``config.json``'s ``model_type``.

A family bundles: its config parser, the exact weight names it expects, the runtime model (paged
KV, fused projections) and the eager fp32 reference (the test oracle). The engine only talks to
the runtime model through the stage interface of :class:`rlt.platform.models.base.LoopedModel`.
"""

from rlt.platform.models.base import LoopedModel, ModelFamily
from rlt.platform.models.ouro import OURO

MODEL_FAMILIES: dict[str, ModelFamily] = {OURO.model_type: OURO}

__all__ = ["LoopedModel", "ModelFamily", "MODEL_FAMILIES"]
