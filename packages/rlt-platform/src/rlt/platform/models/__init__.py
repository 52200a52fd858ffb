"""Model families rlt serves, keyed by ``config.json``'s ``model_type``.

Families: ``ouro`` (Ouro-1.4B/2.6B and -Thinking), ``huginn_raven`` (Huginn-0125), ``nanbeige``
(Nanbeige4.2-3B). A family bundles: its config parser, the exact weight names it expects, the runtime model (paged
KV, fused projections) and the eager fp32 reference (the test oracle). The engine only talks to
the runtime model through the stage interface of :class:`rlt.platform.models.base.LoopedModel`.
"""

from rlt.platform.models.base import LoopedModel, ModelFamily
from rlt.platform.models.huginn import HUGINN
from rlt.platform.models.nanbeige import NANBEIGE
from rlt.platform.models.ouro import OURO

#: Registry by ``model_type``; ``auto_map`` is never consulted and no checkpoint code ever runs.
MODEL_FAMILIES: dict[str, ModelFamily] = {f.model_type: f for f in (OURO, HUGINN, NANBEIGE)}

__all__ = ["LoopedModel", "ModelFamily", "MODEL_FAMILIES"]
