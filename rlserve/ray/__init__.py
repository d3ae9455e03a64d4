"""rlserve on Ray (`pip install rlserve[ray]`): data-parallel replicas placed as Ray actors
behind one OpenAI endpoint, and one push to all of them. See cluster.py."""

from rlserve.ray.cluster import RolloutCluster

__all__ = ["RolloutCluster"]
