"""The shared Redis prefix tier, from its old import path: the store and settings (`worker/prefix_store.py`),
the cost model and the data plane's tier (`worker/redis_tier.py`). Planning is the control plane's
(`core/prefix_tier.py`)."""

from decode_service.engine.worker.prefix_store import PrefixStore, PrefixTierStats, RedisPrefixSettings
from decode_service.engine.worker.redis_tier import CostModel, RedisPrefixTier

__all__ = ["CostModel", "PrefixStore", "PrefixTierStats", "RedisPrefixSettings", "RedisPrefixTier"]
