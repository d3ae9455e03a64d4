"""LoRA adapter routes, with vLLM's paths and payloads (`--enable-lora`):

    POST /v1/load_lora_adapter    {"lora_name", "lora_path", "load_inplace"?}   a PEFT directory
    POST /v1/unload_lora_adapter  {"lora_name", "lora_int_id"?}

A request runs with an adapter by naming it in `model`; /v1/models lists the adapters
with `parent` = the served model. A `lora_path` with no adapter directory is a 404 (vLLM's
"No adapter found"), and so is an adapter that is not loaded. Loading reads files on the
server's disk, so these routes are guarded as the weight-update control plane is
(rlserve/server/security.py).
Adapters a trainer pushes over the weight-transfer plane (`update_info.lora_name`) need
no load: the push creates them.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from rlserve.errors import InvalidRequestError
from rlserve.server.responses import ModelCard
from rlserve.server.security import require_control_access


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, description="a PEFT adapter directory on the server")
    load_inplace: bool = Field(False, description="replace a loaded adapter of the same name")


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's; adapters are known by name here


router = APIRouter(tags=["LoRA adapters"], dependencies=[Depends(require_control_access)])


def _check_name(request: Request, name: str) -> None:
    base = request.app.state.completions.model_name
    if name == base:
        raise InvalidRequestError(f"lora_name: {name!r} is the served model's name; pick another", "lora_name")


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    _check_name(request, body.lora_name)
    await request.app.state.engine.load_lora_adapter(body.lora_name, body.lora_path, body.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    await request.app.state.engine.unload_lora_adapter(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def lora_model_cards(request: Request) -> list[ModelCard]:
    """/v1/models entries of the loaded adapters (none without --enable-lora)."""
    if not request.app.state.config.enable_lora:
        return []
    serving = request.app.state.completions
    return [ModelCard(id=a.name, created=serving.created, root=a.path or a.name,
                      parent=serving.model_name, max_model_len=serving.engine.max_model_len)
            for a in await request.app.state.engine.list_lora_adapters()]


def add_lora_routes(app: FastAPI) -> None:
    app.include_router(router)
