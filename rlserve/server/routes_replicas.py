"""Data-parallel replicas (frontend/dp_client.py), with `--data-parallel-size` above 1:

    GET  /replicas                      each replica: state, weight version, pid, load
    POST /replicas/{index}/attach       {"input": zmq address, "output": zmq address}:
                                        a replica started elsewhere replaces the down one
                                        (rlserve.ray's restarts); answers once it serves
                                        the current weights

Guarded as the control plane is (rlserve/server/security.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from rlserve.server.security import require_control_access

router = APIRouter(tags=["data parallel"], dependencies=[Depends(require_control_access)])


class AttachRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input: str = Field(description="the engine's input address (it binds it)")
    output: str = Field(description="the address this server binds for the engine's messages")


@router.get("/replicas")
async def replicas(request: Request) -> dict:
    return {"replicas": request.app.state.engine.replicas}


@router.post("/replicas/{index}/attach")
async def attach(index: int, body: AttachRequest, request: Request) -> dict:
    engine = request.app.state.engine
    await engine.client.attach(index, body.input, body.output)
    return {"replica": engine.replicas[index]}
