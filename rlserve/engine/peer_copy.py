"""A data-parallel replica that (re)joins copies a healthy replica's weights, and then
takes its version: the engine's side of both replicas (the ranks copy pairwise over
weight_transfer/server/peer.py). The source sends between two of its steps, so the copy
is one version, never half of an update (updates are applied between steps too)."""

from __future__ import annotations

from typing import Any, Protocol

from rlserve.errors import ConflictError
from rlserve.sampling_params import InvalidRequestError
from rlserve.wire.control import PeerCopied
from rlserve.wire.messages import Call, CopyWeightsFromPeer, CopyWeightsToPeer, WeightsLayout
from rlserve.worker import calls as rank


class Updates(Protocol):
    """What the copy needs of the engine's owner of updates (weight_updates.py)."""

    core: Any
    commits: int  # weights copied in so far (a checksum read meanwhile is read again)


class PeerCopy:
    def __init__(self, updates: Updates) -> None:
        self.updates = updates

    def layout(self, call: Call, body: WeightsLayout) -> list[str]:
        return self.updates.core.executor.collective_rpc(rank.WeightsLayout())

    def to_peer(self, call: Call, body: CopyWeightsToPeer) -> PeerCopied:
        core = self.updates.core
        if core.state.weights_asleep:  # the copy reads the weights alone: a sleeping KV cache may stay so
            raise ConflictError("copy_weights_to_peer: this replica's weights are asleep")
        self._check_layouts(body.digests)
        version = core.weight_version
        sizes = core.executor.collective_rpc(rank.CopyPeer(True, body.address, body.ports, None, body.timeout_s))
        return PeerCopied(version, sum(int(x) for x in sizes))

    def from_peer(self, call: Call, body: CopyWeightsFromPeer) -> PeerCopied:
        core = self.updates.core
        if core.state.weights_asleep:
            raise ConflictError("copy_weights_from_peer: this replica's weights are asleep")
        self._check_layouts(body.digests)
        sizes = core.executor.collective_rpc(rank.CopyPeer(False, body.address, body.ports, None, body.timeout_s))
        self.updates.commits += 1
        core.state.no_weights = False
        core.new_weight_version(body.weight_version)
        return PeerCopied(body.weight_version, sum(int(x) for x in sizes))

    def _check_layouts(self, digests: list[str]) -> None:
        # Compared rank by rank here; every rank pair then copies at once.
        mine = self.updates.core.executor.collective_rpc(rank.WeightsLayout())
        if mine != list(digests):
            raise InvalidRequestError(
                f"peer weight copy: parameter layouts differ ({mine} here, {list(digests)} at the source)", "replica"
            )
