"""The data-parallel front end's one owner of weights across replicas (dp_client.py holds
the replicas and routes requests; this module keeps their weights one version):

- `/init_weight_transfer_engine` once for all: replica i's rank r joins the trainer's one
  group at `rank_offset + i*TP + r`; the group is remembered per replica incarnation, so an
  update after a restart asks for a new init rather than hanging on a missing rank;
- each `/update_weights` reaches every replica, all or nothing per replica; a replica
  whose update failed while another's succeeded leaves rotation and copies the new weights;
- a replica that (re)starts copies the weights and version a serving replica has now
  (weight_transfer/server/peer.py) before it serves; with none to copy from, after a push, it
  stays `stale` until the trainer's next push, so it never serves its checkpoint under a
  newer version number.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, Protocol

import msgspec

from rlserve.config import EngineConfig
from rlserve.errors import EngineUnavailableError
from rlserve.frontend.dp_replica import STALE, STARTING, UP, Replica, call_all, combine_errors
from rlserve.frontend.dp_sleep import ReplicaSleep
from rlserve.weight_transfer.address import get_open_port
from rlserve.wire.control import WeightsUpdated
from rlserve.wire.messages import (
    ConflictError,
    CopyWeightsFromPeer,
    CopyWeightsToPeer,
    InitWeightTransfer,
    Pause,
    ShutdownWeightTransfer,
    UpdateWeights,
    WeightsLayout,
)
from rlserve.wire.outputs import EngineStats

logger = logging.getLogger(__name__)


class Front(Protocol):
    """What the weights' owner reads of the front end (DPEngineClient)."""

    config: EngineConfig
    tp: int
    replicas: list[Replica]
    paused: tuple[str, bool] | None  # the last /pause (mode, clear_cache) until /resume
    sleep_state: ReplicaSleep

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None: ...

    async def stats_of(self, r: Replica) -> EngineStats: ...


class ReplicaWeights:
    def __init__(self, front: Front):
        self.front = front
        self.lock = asyncio.Lock()  # one init / update / weight copy at a time
        self.group: dict[int, int] | None = None  # replica -> its incarnation in the trainer's group
        self.pushed = False  # a trainer has replaced the weights since start

    def in_group(self, r: Replica) -> bool:
        return self.group is not None and self.group.get(r.index) == r.incarnation

    async def init_transfer(self, body: InitWeightTransfer) -> None:
        """Every rank of every replica joins the trainer's one group."""
        front = self.front
        async with self.lock:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + body.timeout_s
            while any(r.state == STARTING for r in front.replicas) and loop.time() < deadline:
                await asyncio.sleep(0.2)  # a restarting replica joins too
            missing = [r for r in front.replicas if not r.alive]
            if missing:
                raise EngineUnavailableError(
                    "init_info: every data-parallel replica joins the group, and "
                    + "; ".join(f"replica {r.index} is {r.state} ({r.reason})" for r in missing)
                    + ": retry once /health reports it up")

            def joining(r: Replica) -> InitWeightTransfer:
                info = body.init_info  # None: the ipc backend forms no group
                if info is not None:
                    info = msgspec.structs.replace(info, rank_offset=info.rank_offset + r.index * front.tp)
                return InitWeightTransfer(body.backend, info, body.timeout_s)

            self.group = None
            await call_all(front.replicas, joining)
            self.group = {r.index: r.incarnation for r in front.replicas}

    async def update(self, body: UpdateWeights) -> WeightsUpdated:
        """One update into every replica, each all or nothing."""
        front = self.front
        async with self.lock:
            if self.group is not None:
                gone = [r for r in front.replicas if not (self.in_group(r) and r.alive)]
                if gone:
                    refusal = "update_info: " + "; ".join(map(_out_of_group, gone)) + (
                        ": call /init_weight_transfer_engine again (once /health reports every replica up)")
                    await self.break_group(refusal)
                    raise ConflictError(refusal)
            targets = [r for r in front.replicas if r.alive]
            if not targets:
                raise EngineUnavailableError("no data-parallel replica is up")
            got = await asyncio.gather(*(r.client.call(body) for r in targets), return_exceptions=True)
            ok: dict[int, WeightsUpdated] = {r.index: v for r, v in zip(targets, got)
                                             if not isinstance(v, BaseException)}
            failed = [(r.index, e) for r, e in zip(targets, got) if isinstance(e, BaseException)]
            for r in targets:
                if r.index in ok:
                    r.weight_version = ok[r.index].weight_version
                    if r.state == STALE:  # it has the trainer's weights now
                        r.state, r.reason = UP, ""
            if ok:
                self.pushed = True
            if failed and ok:
                for i, e in failed:
                    r = front.replicas[i]
                    if r.alive:
                        r.state, r.reason = STALE, f"its update failed ({e}): copying from a replica that succeeded"
                        front.spawn(self.catch_up(r))
            if failed:
                done = "; ".join(f"replica {i} now serves version {v.weight_version}" for i, v in ok.items())
                raise combine_errors(failed, done)
        first = next(iter(ok.values()))  # inside a transaction, every replica's is open: staged alike
        return msgspec.structs.replace(
            first, receive_seconds=max(v.receive_seconds for v in ok.values()),
            apply_seconds=max(v.apply_seconds for v in ok.values()),
            replicas=[msgspec.structs.replace(v, replica=i) for i, v in sorted(ok.items())])

    async def break_group(self, reason: str) -> None:
        """The trainer's group lost ranks: the replicas still in it leave it, saying why,
        so a trainer that is pushing raises `reason` at once rather than at its timeout
        (it waits for every rank's answer, and the lost ones never give one)."""
        members = [r for r in self.front.replicas if self.in_group(r) and r.alive]
        got = await asyncio.gather(*(r.client.call(ShutdownWeightTransfer(reason)) for r in members),
                                   return_exceptions=True)
        for r, e in zip(members, got):
            if isinstance(e, BaseException):
                logger.warning("replica %d: leaving the trainer's group failed: %s", r.index, e)

    async def catch_up(self, r: Replica) -> None:
        """Give replica r the weights and version the serving replicas have now."""
        front = self.front
        async with self.lock:
            if not r.alive:
                return
            source = next((x for x in front.replicas if x.state == UP and x is not r), None)
            asleep = front.sleep_state.weights_asleep
            if source is None or asleep:
                try:  # it sleeps as the others do, holding none of the memory they gave back
                    await front.sleep_state.match(r)
                except Exception as e:
                    logger.error("replica %d: putting it to sleep as the others failed: %s", r.index, e)
                if asleep:
                    r.state = STALE
                    r.reason = "the replicas' weights are asleep: it copies them once /wake_up wakes them"
                    logger.info("replica %d: %s", r.index, r.reason)
                    return
                if self.pushed:
                    r.state = STALE
                    r.reason = ("no awake replica to copy the current weights from: it serves after "
                                "the trainer's next /init_weight_transfer_engine and /update_weights")
                    logger.warning("replica %d: %s", r.index, r.reason)
                    return
                r.state, r.reason = UP, ""  # nothing pushed yet: its checkpoint is current
                return
            try:
                await self._copy(source, r)
                await front.sleep_state.match(r)
                if front.paused is not None:
                    await r.client.call(Pause(*front.paused))
            except Exception as e:
                r.state, r.reason = STALE, f"copying weights from replica {source.index} failed: {e}"
                logger.error("replica %d: %s", r.index, r.reason)
                return
            r.state, r.reason = UP, ""
            logger.info("replica %d is serving again, weight version %s", r.index, r.weight_version)

    async def _copy(self, source: Replica, target: Replica) -> None:
        config = self.front.config
        timeout_s = config.weight_transfer.timeout_s if config.weight_transfer else 120.0
        digests = await source.client.call(WeightsLayout())
        version = (await self.front.stats_of(source)).weight_version
        assert source.info is not None  # it serves: it has started
        host = source.info.host if config.dp_engines is not None else "127.0.0.1"
        ports = [get_open_port() for _ in range(self.front.tp)]
        both = await asyncio.gather(
            source.client.call(CopyWeightsToPeer(host, ports, digests, timeout_s)),
            target.client.call(CopyWeightsFromPeer(host, ports, digests, timeout_s, version)),
            return_exceptions=True)
        sent, got = both  # not unpacked from the await: mypy 2.4 then loses both types
        if isinstance(sent, BaseException):
            raise sent
        if isinstance(got, BaseException):
            raise got
        target.weight_version = version
        logger.info("replica %d: copied %.1f MB of weights (version %d) from replica %d",
                    target.index, got.num_bytes / 1e6, version, source.index)


def _out_of_group(r: Replica) -> str:
    if r.alive:
        return (f"replica {r.index} restarted since /init_weight_transfer_engine, so its ranks are not "
                "in the trainer's group")
    return f"replica {r.index} is {r.state} ({r.reason}), so its ranks cannot receive"
