"""The ipc backend's wire format and configuration, checked without a GPU.

Opening real handles, the colocated flow of vLLM's RLHF-over-HTTP example and the push timings run on the GPU
(tests/gpu/test_gpu_colocated.py).
"""

from __future__ import annotations

import base64
import copy

import pytest
import torch

from rlserve.config import EngineConfig
from rlserve.weight_transfer import InvalidUpdateError, TensorMeta, UpdateInfo
from rlserve.weight_transfer.ipc import IPCHandles, SharedTensor, parse_ipc_init_info, view_of
from rlserve.weight_transfer.packing import tensor_metas

METAS = [TensorMeta("model.embed_tokens.weight", "bfloat16", (8, 4)),
         TensorMeta("model.norm.weight", "float32", (4,))]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def valid_doc() -> dict:
    storage = {"handle": b64(b"\x01" * 64), "size_bytes": 4096, "offset_bytes": 512,
               "ref_counter_handle": b64(b"/torch_123_456_0"), "ref_counter_offset": 3,
               "event_handle": b64(b"\x02" * 64), "event_sync_required": True}
    return {"device_uuid": "GPU-0f0f", "storages": [storage, dict(storage, offset_bytes=0)],
            "tensors": [{"storage": 0, "offset": 0, "stride": [4, 1]},
                        {"storage": 1, "offset": 16, "stride": [1]}]}


def test_valid_handles_parse_and_round_trip():
    handles = IPCHandles.parse(valid_doc(), METAS)
    assert handles.storages[0].handle == b"\x01" * 64
    assert handles.storages[0].key != handles.storages[1].key  # same allocation, other offset
    assert handles.tensors[1] == SharedTensor(1, 16, (1,))
    assert IPCHandles.parse(handles.to_json(), METAS) == handles


def _set(doc: dict, path: str, value) -> dict:
    doc = copy.deepcopy(doc)
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    if value is _DELETE:
        del node[int(last) if last.isdigit() else last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return doc


_DELETE = object()


@pytest.mark.parametrize("path,value,fragment", [
    ("device_uuid", "", "device_uuid"),
    ("storages", {}, "storages: must be a list"),
    ("tensors", [], "one entry per name (2), got 0"),
    ("storages.0.handle", "not base64!", "storages[0].handle: must be base64"),
    ("storages.0.handle", b64(b"x" * 2000), "storages[0].handle: must be base64 of 1..1024"),
    ("storages.0.ref_counter_handle", b64(b"/etc/passwd"), "not a torch IPC counter name"),
    ("storages.0.ref_counter_offset", 10000, "ref_counter_offset: must be an integer in 0..9999"),
    ("storages.1.size_bytes", 0, "storages[1].size_bytes: must be a positive integer"),
    ("storages.1.offset_bytes", -1, "offset_bytes: must be a non-negative integer"),
    ("storages.0.event_sync_required", "yes", "event_sync_required: must be true or false"),
    ("storages.0.event_handle", "", "event_handle: required when event_sync_required"),
    ("storages.0.extra", 1, "unknown field(s) extra"),
    ("storages.0.handle", _DELETE, "missing handle"),
    ("tensors.0.storage", 2, "tensors[0] (model.embed_tokens.weight).storage: must index storages (0..1)"),
    ("tensors.0.stride", [4], "stride: must be 2 non-negative integers"),
    ("tensors.1.offset", -5, "offset: must be a non-negative integer"),
    # 8 x 4 bf16 at stride [500, 1] ends past the 4096-byte storage: no stray reads.
    ("tensors.0.stride", [500, 1], "past the end of its storage (4096 bytes)"),
    ("tensors.1.offset", 1021, "the view ends at byte 4100"),
    ("id", "", "id: must be a string of 1 to 64 characters"),
    ("id", "x" * 65, "id: must be a string of 1 to 64 characters"),
    ("id", 7, "id: must be a string"),
])
def test_malformed_handles_are_refused_naming_the_field(path, value, fragment):
    with pytest.raises(InvalidUpdateError) as e:
        IPCHandles.parse(_set(valid_doc(), path, value), METAS)
    assert fragment in str(e.value)


def test_a_document_may_name_itself():
    """The id a later push refers to (ipc_handles.same_as) parses alongside the handles."""
    doc = dict(valid_doc(), id="a3f9c2")
    assert IPCHandles.parse(doc, METAS) == IPCHandles.parse(valid_doc(), METAS)


def test_missing_handles_and_top_level_shape():
    with pytest.raises(InvalidUpdateError, match="required with the ipc backend"):
        IPCHandles.parse(None, METAS)
    with pytest.raises(InvalidUpdateError, match="missing tensors; unknown field"):
        IPCHandles.parse({"device_uuid": "x", "storages": [], "handles": []}, METAS)


def test_update_info_carries_the_handles_through():
    info = UpdateInfo.parse({"names": [m.name for m in METAS],
                             "dtype_names": [m.dtype_name for m in METAS],
                             "shapes": [list(m.shape) for m in METAS],
                             "ipc_handles": valid_doc()})
    assert IPCHandles.parse(info.ipc_handles, tensor_metas(info)).device_uuid == "GPU-0f0f"


def test_views_at_offset_and_stride_read_the_right_elements():
    base = torch.arange(64, dtype=torch.float32)
    meta = TensorMeta("w", "float32", (3, 4))
    # A transposed slice: what a trainer's non-contiguous parameter looks like.
    view = view_of(base.untyped_storage(), meta, SharedTensor(0, 5, (1, 8)))
    assert torch.equal(view, base[5:].as_strided((3, 4), (1, 8)))
    bf = torch.randn(10, dtype=torch.bfloat16)
    view = view_of(bf.untyped_storage(), TensorMeta("b", "bfloat16", (4,)), SharedTensor(0, 6, (1,)))
    assert torch.equal(view, bf[6:10])


def test_init_info_for_ipc():
    parse_ipc_init_info({})
    # A script written for nccl keeps its init call.
    parse_ipc_init_info({"master_address": "x", "master_port": 1, "rank_offset": 1, "world_size": 2})
    with pytest.raises(InvalidUpdateError, match="unknown field"):
        parse_ipc_init_info({"handles": []})
    with pytest.raises(InvalidUpdateError, match="must be a JSON object"):
        parse_ipc_init_info([])


def test_ipc_backend_needs_cuda_and_one_rank():
    with pytest.raises(ValueError, match="backend ipc needs a CUDA device"):
        EngineConfig(model="x", device="cpu", weight_transfer='{"backend": "ipc"}')
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        EngineConfig(model="x", device="cuda", tensor_parallel_size=2,
                     weight_transfer={"backend": "ipc"})


def test_trainer_send_weights_arguments():
    from rlserve.weight_transfer import IPCWeightTransferEngine
    # Other backends' and vLLM's arguments are accepted (and ignored), as keywords or trainer_args...
    for kwargs in ({"packed": True, "packed_buffer_size_bytes": 1 << 20},
                   {"trainer_args": {"mode": "http", "url": "http://x", "packed_num_buffers": 2}}):
        with pytest.raises(TypeError, match="group must be the IPCSender"):
            IPCWeightTransferEngine.trainer_send_weights(iter([]), **kwargs)
    # ...a misspelt one is not silently dropped.
    with pytest.raises(TypeError, match=r"unknown arguments \['weight_versoin'\]"):
        IPCWeightTransferEngine.trainer_send_weights(iter([]), weight_versoin=3)
    with pytest.raises(TypeError, match=r"unknown arguments \['ulr'\]"):
        IPCWeightTransferEngine.trainer_send_weights(iter([]), {"ulr": "http://x"})
