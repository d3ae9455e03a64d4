"""Weight transfer over gloo on CPU: bucket plans, handshake refusals, failures, re-init.

Transfers run the trainer in a spawned process (a real peer that can die) and
the receiver in the test process; timeout and multi-rank cases use threads.
Every wait is bounded by a few seconds.
"""

from __future__ import annotations

import os
import queue
import select
import socket
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from rlserve.weight_transfer import (
    ExpectedParam,
    GlooWeightTransferEngine,
    InitInfo,
    InvalidUpdateError,
    TensorMeta,
    TransferGroup,
    UpdateInfo,
    UpdateRefusedError,
    WeightTransferError,
    get_ip,
    get_open_port,
    plan_buckets,
    plan_digest,
    receive_weights,
    receiver_init,
    rendezvous_address,
)
from rlserve.weight_transfer.address import is_loopback, local_ip_towards
from rlserve.weight_transfer.packing import ALIGN_BYTES, tensor_metas

TIMEOUT_S = 8.0  # per blocking call; a hang fails the test within this
BUCKET = 4096  # small, so the test model spans several packed buckets


# --- a small model both sides can rebuild ------------------------------------

def make_params(variant: str = "base") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    p = {
        "embed.weight": torch.randn(37, 11, generator=g),
        "layers.0.qkv.weight": torch.randn(13, 7, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(5, generator=g).to(torch.float16),
        "layers.0.scale": torch.randn((), generator=g),
        "layers.0.empty": torch.empty(0, 3),
        "layers.1.mlp.weight": torch.randn(23, 29, generator=g),
        "layers.1.bias": torch.randn(301, generator=g).to(torch.bfloat16),
        "lm_head.weight": torch.randn(64, 33, generator=g),  # 8448 bytes: bigger than a bucket
        "layers.2.w": torch.randn(17, 19, generator=g),
        "final_norm.weight": torch.randn(9, generator=g).to(torch.bfloat16),
    }
    if variant == "unknown":
        p["bogus.weight"] = torch.zeros(4)
        p["also.bogus"] = torch.zeros(2)
    elif variant == "shape":
        p["embed.weight"] = p["embed.weight"].t().contiguous()
    elif variant == "int":
        p["layers.0.norm.weight"] = torch.arange(5)
    elif variant == "missing":
        del p["lm_head.weight"]
    return p


def expected_params() -> dict[str, ExpectedParam]:
    return {n: ExpectedParam(tuple(t.shape)) for n, t in make_params().items()}


def update_info(params: dict[str, torch.Tensor], **extra) -> dict:
    # Exactly how vLLM's RLHF-over-HTTP example builds it.
    return dict(names=list(params), dtype_names=[str(p.dtype).split(".")[-1] for p in params.values()],
                shapes=[list(p.shape) for p in params.values()], **extra)


# --- the trainer process --------------------------------------------------------

def _trainer_proc(port: int, steps: list, results, die_at_broadcast: int | None = None) -> None:
    try:
        group = GlooWeightTransferEngine.trainer_init(
            dict(master_address="127.0.0.1", master_port=port, world_size=2, timeout_s=TIMEOUT_S))
        if die_at_broadcast is not None:
            calls, real = [0], TransferGroup.broadcast

            def dying_broadcast(self, tensor, src=0):
                calls[0] += 1
                if calls[0] == die_at_broadcast:
                    os._exit(17)  # as abrupt as a crash: no cleanup, sockets just close
                return real(self, tensor, src)

            TransferGroup.broadcast = dying_broadcast
        for variant, kwargs in steps:
            try:
                GlooWeightTransferEngine.trainer_send_weights(
                    iterator=make_params(variant).items(), group=group, **kwargs)
                results.put(("ok", ""))
            except Exception as e:
                results.put((type(e).__name__, str(e)))
    except Exception as e:
        results.put(("init failed", repr(e)))


def start_trainer(steps, die_at_broadcast=None):
    ctx = mp.get_context("spawn")
    port, results = get_open_port(), ctx.Queue()
    proc = ctx.Process(target=_trainer_proc, args=(port, steps, results, die_at_broadcast), daemon=True)
    proc.start()
    return port, proc, results


def join_receiver(port: int) -> TransferGroup:
    # Spawning the trainer takes a few seconds (torch import): allow for it in init only.
    return receiver_init("gloo", dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2),
                         worker_rank=0, device="cpu", timeout_s=TIMEOUT_S + 20)


def trainer_result(results) -> tuple[str, str]:
    return results.get(timeout=TIMEOUT_S * 2)


def assert_bit_identical(received: list[tuple[str, torch.Tensor]], sent: dict[str, torch.Tensor]) -> None:
    assert [n for n, _ in received] == list(sent)
    for name, t in received:
        ref = sent[name]
        assert t.dtype == ref.dtype and t.shape == ref.shape, name
        assert torch.equal(t.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)), name


# --- bucket plans -----------------------------------------------------------------

def metas_of(params):
    return [TensorMeta.of(n, t) for n, t in params.items()]


def test_plan_buckets_packed_alignment_and_oversize():
    metas = metas_of(make_params())
    buckets = plan_buckets(metas, packed=True, bucket_size_bytes=BUCKET)
    seen = [s.index for b in buckets for s in b.slots]
    assert seen == list(range(len(metas)))  # every tensor once, in order
    for b in buckets:
        for s in b.slots:
            assert s.offset % ALIGN_BYTES == 0 and s.nbytes == metas[s.index].nbytes
        ends = [s.offset + s.nbytes for s in b.slots]
        assert b.nbytes == ends[-1]
        assert all(a <= s.offset for a, s in zip(ends, b.slots[1:]))  # no overlap
        if b.direct:
            assert len(b.slots) == 1 and b.nbytes > BUCKET
        else:
            assert b.nbytes <= BUCKET
    oversize = [b for b in buckets if b.direct]
    assert [metas[b.slots[0].index].name for b in oversize] == ["lm_head.weight"]
    assert sum(not b.direct for b in buckets) >= 3  # the ring of 2 buffers gets reused


def test_plan_buckets_unpacked_and_edge_cases():
    metas = metas_of(make_params())
    buckets = plan_buckets(metas, packed=False, bucket_size_bytes=BUCKET)
    assert [b.slots[0].index for b in buckets] == list(range(len(metas)))
    assert all(b.direct and len(b.slots) == 1 for b in buckets)
    assert plan_buckets([], packed=True, bucket_size_bytes=BUCKET) == []
    # A tensor exactly the bucket size fits; two of them need two buckets.
    exact = [TensorMeta("a", "float32", (BUCKET // 4,)), TensorMeta("b", "float32", (BUCKET // 4,))]
    assert [(b.nbytes, b.direct) for b in plan_buckets(exact, True, BUCKET)] == [(BUCKET, False)] * 2
    with pytest.raises(ValueError):
        plan_buckets(exact, True, 0)


def _greedy_plan(metas, bucket_size):
    """The packing rule, one tensor at a time: each at the next aligned offset, a new
    bucket when it would not fit, a tensor bigger than a bucket alone."""
    buckets, cur, end = [], [], 0
    for i, m in enumerate(metas):
        n = m.nbytes
        if n > bucket_size:
            if cur:
                buckets.append((cur, end, False))
                cur = []
            buckets.append(([(i, 0, n)], n, True))
            continue
        offset = -(-end // ALIGN_BYTES) * ALIGN_BYTES if cur else 0
        if cur and offset + n > bucket_size:
            buckets.append((cur, end, False))
            cur, offset = [], 0
        cur.append((i, offset, n))
        end = offset + n
    if cur:
        buckets.append((cur, end, False))
    return buckets


def test_plan_buckets_follows_the_greedy_rule_on_random_lists():
    rng = torch.Generator().manual_seed(0)
    dtypes = ["float32", "bfloat16", "float8_e4m3fn", "float64"]
    for trial in range(200):
        count = int(torch.randint(0, 60, (), generator=rng))
        dims = torch.randint(0, 700, (count, 2), generator=rng).tolist()
        metas = [TensorMeta(f"t{i}", dtypes[(i * 7 + trial) % 4], tuple(d[: 1 + (i + trial) % 2]))
                 for i, d in enumerate(dims)]
        size = int(torch.randint(1, 5000, (), generator=rng))
        got = [([tuple(s) for s in b.slots], b.nbytes, b.direct) for b in plan_buckets(metas, True, size)]
        assert got == _greedy_plan(metas, size), (trial, size)


def test_plan_is_the_same_on_both_sides():
    params = make_params()
    trainer_metas = metas_of(params)  # from real tensors
    server_metas = tensor_metas(UpdateInfo.parse(update_info(params, packed=True)))  # from the JSON
    assert trainer_metas == server_metas
    for packed in (True, False):
        assert plan_buckets(trainer_metas, packed, BUCKET) == plan_buckets(server_metas, packed, BUCKET)
        assert plan_digest(trainer_metas, packed, BUCKET) == plan_digest(server_metas, packed, BUCKET)


def test_plan_digest_changes_with_layout():
    metas = metas_of(make_params())
    base = plan_digest(metas, True, BUCKET)
    renamed = [metas[0]._replace(name="other")] + metas[1:]
    recast = [metas[0]._replace(dtype_name="bfloat16")] + metas[1:]
    reshaped = [metas[0]._replace(shape=(11, 37))] + metas[1:]
    for variant in (renamed, recast, reshaped, metas[::-1], metas[:-1]):
        assert plan_digest(variant, True, BUCKET) != base
    assert plan_digest(metas, False, BUCKET) != base
    assert plan_digest(metas, True, BUCKET * 2) != base
    # Unpacked transfers do not depend on the buffer size.
    assert plan_digest(metas, False, BUCKET) == plan_digest(metas, False, BUCKET * 2)


# --- request validation ----------------------------------------------------------

@pytest.mark.parametrize("change, fragment", [
    (dict(dtype_names=["float32"]), "same length"),
    (dict(dtype_names=["float32", "complex64"]), "unknown dtype for b ('complex64')"),
    (dict(shapes=[[2], [-1]]), "non-negative integers: b ([-1])"),
    (dict(shapes=[[2], [1.5]]), "non-negative integers: b"),
    (dict(names=["a", "a"]), "duplicates a"),
    (dict(packed="yes"), "packed must be true or false"),
    (dict(packed_num_buffers=0), "packed_num_buffers"),
    (dict(packed_buffer_size_bytes=-5), "packed_buffer_size_bytes"),
    (dict(colour="red"), "unknown field(s) colour"),
])
def test_update_info_parse_errors(change, fragment):
    data = dict(names=["a", "b"], dtype_names=["float32", "bfloat16"], shapes=[[2], [3, 4]])
    data.update(change)
    with pytest.raises(InvalidUpdateError) as err:
        UpdateInfo.parse(data)
    assert fragment in str(err.value)


def test_update_info_parse_defaults_and_long_lists():
    info = UpdateInfo.parse(dict(names=["a"], dtype_names=["float16"], shapes=[[]], weight_version=3))
    assert info.packed is False and info.packed_num_buffers == 2 and info.weight_version == 3
    n = 25
    with pytest.raises(InvalidUpdateError) as err:
        UpdateInfo.parse(dict(names=[f"p{i}" for i in range(n)], dtype_names=["nope"] * n, shapes=[[1]] * n))
    assert "p9 ('nope')" in str(err.value) and "p10" not in str(err.value) and "(and 15 more)" in str(err.value)


def test_init_info_parse_errors():
    good = dict(master_address="127.0.0.1", master_port=1234, rank_offset=1, world_size=3)
    assert InitInfo.parse(good, num_workers=2).world_size == 3
    for change, fragment in [(dict(world_size=2), "too small"), (dict(rank_offset=0), "rank_offset"),
                             (dict(master_port=70000), "master_port"), (dict(extra=1), "unknown field")]:
        with pytest.raises(InvalidUpdateError, match=fragment):
            InitInfo.parse({**good, **change}, num_workers=2)
    assert get_ip() and 0 < get_open_port() < 65536


def test_rendezvous_address_is_loopback_for_local_servers(monkeypatch):
    for urls in ("http://127.0.0.1:8000", "http://localhost:8000/", ["http://[::1]:9"],
                 ["http://127.0.0.2:1", "http://localhost:2"], "127.0.0.1:8000"):
        assert rendezvous_address(urls) == "127.0.0.1", urls
    # A server elsewhere: the local end of the route to it (whatever this host has).
    assert rendezvous_address(["http://127.0.0.1:1", "http://192.0.2.7:8000"]) == local_ip_towards("192.0.2.7")
    assert is_loopback("127.0.0.5") and is_loopback("localhost") and not is_loopback("192.0.2.7")
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")  # vLLM's override, which get_ip honours
    assert get_ip() == "127.0.0.1"


# --- transfers between processes -------------------------------------------------

def test_roundtrip_packed_and_unpacked_bit_identical():
    steps = [("base", dict(packed=True, packed_buffer_size_bytes=BUCKET)),
             ("base", dict(packed=False)),
             ("base", dict(packed=True, packed_buffer_size_bytes=BUCKET, packed_num_buffers=3))]
    port, proc, results = start_trainer(steps)
    group = join_receiver(port)
    group.timeout_s = TIMEOUT_S
    params = make_params()
    try:
        out = receive_weights(group, update_info(params, packed=True, packed_buffer_size_bytes=BUCKET),
                              expected_params())
        assert_bit_identical(out, params)
        assert trainer_result(results) == ("ok", "")

        out = receive_weights(group, UpdateInfo.parse(update_info(params, packed=False)), expected_params())
        assert_bit_identical(out, params)
        assert trainer_result(results) == ("ok", "")

        # Floating dtypes other than the server's are cast on copy.
        expected = expected_params()
        expected["layers.0.qkv.weight"] = ExpectedParam((13, 7), dtype=torch.float32)
        out = dict(receive_weights(group, update_info(params, packed=True, packed_buffer_size_bytes=BUCKET,
                                                      packed_num_buffers=3), expected))
        assert out["layers.0.qkv.weight"].dtype == torch.float32
        assert torch.equal(out["layers.0.qkv.weight"], params["layers.0.qkv.weight"].float())
        assert trainer_result(results) == ("ok", "")
    finally:
        group.close()
        proc.join(TIMEOUT_S)


REFUSALS = [  # (what the trainer sends, update_info packed, fragments of the message)
    ("unknown", True, ["unknown parameter names: bogus.weight, also.bogus"]),
    ("shape", True, ["wrong shapes: embed.weight (got [11, 37], expected [37, 11])"]),
    ("int", False, ["non-floating dtypes", "layers.0.norm.weight (int64)"]),
    ("missing", True, ["missing required parameters: lm_head.weight"]),
    ("base", False, ["does not match what the trainer sends", "packed=True"]),  # info says unpacked
]


def test_refused_update_fails_on_both_sides_and_group_survives():
    steps = [(variant, dict(packed=True, packed_buffer_size_bytes=BUCKET)) for variant, _, _ in REFUSALS]
    steps.append(("base", dict(packed=True, packed_buffer_size_bytes=BUCKET)))
    port, proc, results = start_trainer(steps)
    group = join_receiver(port)
    group.timeout_s = TIMEOUT_S
    try:
        for variant, packed, fragments in REFUSALS:
            started = time.monotonic()
            info = update_info(make_params(variant), packed=packed, packed_buffer_size_bytes=BUCKET)
            with pytest.raises(InvalidUpdateError) as err:
                receive_weights(group, info, expected_params())
            message = str(err.value)
            for fragment in fragments:
                assert fragment in message, (variant, message)
            # The trainer raises the very message the server would put in its HTTP 400.
            assert trainer_result(results) == (UpdateRefusedError.__name__, message), variant
            assert time.monotonic() - started < TIMEOUT_S / 2  # refused quickly, no timeout involved
        # A refusal moves no bytes, so the same group carries the next update.
        params = make_params()
        out = receive_weights(group, update_info(params, packed=True, packed_buffer_size_bytes=BUCKET),
                              expected_params())
        assert_bit_identical(out, params)
        assert trainer_result(results) == ("ok", "")
    finally:
        group.close()
        proc.join(TIMEOUT_S)


def test_trainer_killed_midway_then_fresh_init_works():
    # Broadcast #1 is the init probe; the trainer dies starting bucket 3.
    send = ("base", dict(packed=True, packed_buffer_size_bytes=BUCKET))
    port, proc, _ = start_trainer([send], die_at_broadcast=4)
    group = join_receiver(port)
    group.timeout_s = TIMEOUT_S
    params = make_params()
    info = update_info(params, packed=True, packed_buffer_size_bytes=BUCKET)
    started = time.monotonic()
    with pytest.raises(WeightTransferError) as err:
        receive_weights(group, info, expected_params())
    assert time.monotonic() - started < TIMEOUT_S + 2
    # Gloo buffers small sends, so the trainer can set its go-ahead, send two buckets and die
    # before a slow receiver reads the go-ahead: then the store's loss is what it notices.
    message = str(err.value)
    assert "bucket" in message or "closed the connection" in message, message
    proc.join(TIMEOUT_S)
    assert proc.exitcode == 17
    with pytest.raises(WeightTransferError, match="unusable"):
        receive_weights(group, info, expected_params())
    group.close()

    port, proc, results = start_trainer([send])
    group = join_receiver(port)
    try:
        assert_bit_identical(receive_weights(group, info, expected_params()), params)
        assert trainer_result(results) == ("ok", "")
    finally:
        group.close()
        proc.join(TIMEOUT_S)


# --- in-process groups (threads): timeouts and several receiving ranks ------------

def _in_threads(world_size: int, receiver_fns, timeout_s: float, trainer_fn):
    """Run the trainer and each receiver rank in its own thread; return their outcomes."""
    port, outcomes = get_open_port(), queue.Queue()
    init = dict(master_address="127.0.0.1", master_port=port, world_size=world_size, timeout_s=timeout_s)

    def run(role, fn):
        try:
            if role == 0:
                group = GlooWeightTransferEngine.trainer_init(init)
            else:
                group = receiver_init("gloo", {**{k: v for k, v in init.items() if k != "timeout_s"},
                                               "rank_offset": 1}, role - 1, "cpu", timeout_s)
            outcomes.put((role, "ok", fn(group)))
        except Exception as e:
            outcomes.put((role, type(e).__name__, str(e)))

    threads = [threading.Thread(target=run, args=(0, trainer_fn), daemon=True)]
    threads += [threading.Thread(target=run, args=(r + 1, fn), daemon=True) for r, fn in enumerate(receiver_fns)]
    for t in threads:
        t.start()
    got = {}
    for _ in threads:
        role, kind, value = outcomes.get(timeout=timeout_s * 3)
        got[role] = (kind, value)
    return got


def test_both_sides_time_out_when_the_peer_never_calls():
    params = make_params()
    started = time.monotonic()
    # Receiver waits for a trainer that never sends; trainer-side is a separate check below.
    got = _in_threads(2, [lambda g: receive_weights(g, update_info(params), expected_params())], 1.0,
                      lambda g: time.sleep(1.5))
    assert got[1][0] == "WeightTransferError" and "the trainer's plan" in got[1][1]
    got = _in_threads(2, [lambda g: time.sleep(1.5)], 1.0,
                      lambda g: GlooWeightTransferEngine.trainer_send_weights(iterator=params.items(), group=g))
    assert got[0][0] == "WeightTransferError" and "verdict of receiver rank 1" in got[0][1]
    assert time.monotonic() - started < 12


def test_one_rank_refusing_stops_every_rank():
    params = make_params()
    info = update_info(params, packed=True, packed_buffer_size_bytes=BUCKET)
    narrow = {n: p for n, p in expected_params().items() if n != "embed.weight"}  # rank 2 lacks a name
    got = _in_threads(
        3,
        [lambda g: receive_weights(g, info, expected_params()), lambda g: receive_weights(g, info, narrow)],
        TIMEOUT_S,
        lambda g: GlooWeightTransferEngine.trainer_send_weights(
            iterator=params.items(), group=g, packed=True, packed_buffer_size_bytes=BUCKET),
    )
    message = "update_info refused: unknown parameter names: embed.weight"
    assert got[2] == ("InvalidUpdateError", message)
    assert got[1] == ("InvalidUpdateError", message)  # voted ok, stopped by the go key
    assert got[0] == ("UpdateRefusedError", message)


def test_init_fails_fast_and_clearly():
    port = get_open_port()
    started = time.monotonic()
    with pytest.raises(WeightTransferError, match="nothing accepts connections"):  # no trainer
        receiver_init("gloo", dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2),
                      timeout_s=1.0)
    with pytest.raises(WeightTransferError, match="did every server worker join"):  # no receiver
        GlooWeightTransferEngine.trainer_init(
            dict(master_address="127.0.0.1", master_port=port, world_size=2, timeout_s=1.0))
    assert time.monotonic() - started < 5
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        with pytest.raises(WeightTransferError, match="init failed"):  # port taken
            GlooWeightTransferEngine.trainer_init(
                dict(master_address="127.0.0.1", master_port=port, world_size=2, timeout_s=1.0))


# --- checksums --------------------------------------------------------------------

def test_checksum_sees_every_word_and_the_tail():
    from rlserve.weight_transfer.checksum import ROW_WORDS, checksum
    g = torch.Generator().manual_seed(7)
    for n in (1, 7, 8, 13, 8 * ROW_WORDS, 8 * ROW_WORDS * 3 + 21):
        buf = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        base = checksum(buf)
        assert checksum(buf.clone()) == base
        # Any byte, any bit (the top bit of a word included): the value changes.
        for pos in {0, n // 2, n - 1, min(n - 1, 8 * ROW_WORDS)}:
            for bit in (0, 7):
                flipped = buf.clone()
                flipped[pos] ^= 1 << bit
                assert checksum(flipped) != base, (n, pos, bit)
    # Rows swapped, a shorter or a longer buffer: different.
    buf = torch.randint(0, 256, (8 * ROW_WORDS * 2,), dtype=torch.uint8, generator=g)
    swapped = torch.cat([buf[8 * ROW_WORDS:], buf[: 8 * ROW_WORDS]])
    assert checksum(swapped) != checksum(buf)
    assert checksum(buf[:-8]) != checksum(buf)
    assert checksum(torch.cat([buf, buf[:8]])) != checksum(buf)


def test_checksum_does_not_depend_on_alignment_or_where_it_runs():
    from rlserve.weight_transfer.checksum import ROW_WORDS, checksum, device_checksum_into
    g = torch.Generator().manual_seed(3)
    for n in (5, 10_003, 8 * ROW_WORDS * 5 + 3):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        padded = torch.cat([torch.zeros(3, dtype=torch.uint8), data])
        assert checksum(padded[3:]) == checksum(data)  # a view at an odd address
        # The host (numpy) and device (torch ops; CUDA's code, run here on the CPU) agree.
        out = torch.zeros(1, dtype=torch.int64)
        device_checksum_into(data, out)
        assert int(out) == checksum(data)
    big = torch.full((8 * ROW_WORDS * 3,), 0x7F, dtype=torch.uint8)  # sums that wrap around
    out = torch.zeros(1, dtype=torch.int64)
    device_checksum_into(big, out)
    assert int(out) == checksum(big)


# --- failures before the first byte -----------------------------------------------

def test_trainer_failing_before_sending_cancels_at_once():
    params = make_params()
    info = update_info(params)

    def broken_iterator():
        yield "embed.weight", params["embed.weight"]
        raise RuntimeError("the optimizer step blew up")

    spread = [(n, t) for n, t in params.items()] + [("meta.weight", torch.empty(2, device="meta"))]
    for items, error, fragment in [(broken_iterator(), "RuntimeError", "the optimizer step blew up"),
                                   (iter(spread), "ValueError", "spread over several devices (cpu, meta)")]:
        started = time.monotonic()
        got = _in_threads(2, [lambda g: receive_weights(g, info, expected_params())], TIMEOUT_S,
                          lambda g, it=items: GlooWeightTransferEngine.trainer_send_weights(iterator=it, group=g))
        assert got[0] == (error, got[0][1]) and fragment in got[0][1]
        assert got[1][0] == "InvalidUpdateError" and "the trainer cancelled this update" in got[1][1]
        assert fragment in got[1][1]
        assert time.monotonic() - started < TIMEOUT_S / 2


def test_a_rank_that_never_answers_is_named_and_the_other_stops():
    params = make_params()
    info = update_info(params)
    got = _in_threads(3, [lambda g: receive_weights(g, info, expected_params()), lambda g: time.sleep(2.5)], 2.0,
                      lambda g: GlooWeightTransferEngine.trainer_send_weights(iterator=params.items(), group=g))
    assert got[0][0] == "WeightTransferError"
    assert "the verdict of receiver rank 2 did not arrive" in got[0][1] and "still usable" in got[0][1]
    assert got[1][0] == "WeightTransferError" and "receiver rank 2" in got[1][1]


def test_master_address_must_be_a_host_or_unicast_ip():
    from rlserve.weight_transfer.address import address_problem
    for good in ["127.0.0.1", "10.1.2.3", "::1", "[::1]", "trainer-0", "node7.cluster.local", "localhost."]:
        assert address_problem(good) is None, good
    for bad in ["", None, 5, "not a host!", "999.1.1.1", "1.2.3", "0.0.0.0", "::", "224.0.0.1",
                "255.255.255.255", "-bad-.example", "a..b", "x" * 64 + ".com"]:
        assert address_problem(bad), bad
    with pytest.raises(InvalidUpdateError, match="master_address"):
        InitInfo.parse(dict(master_address="0.0.0.0", master_port=1234, rank_offset=1, world_size=2))


# --- the TCP data plane ----------------------------------------------------------

def test_frames_are_read_exactly_or_refused():
    from rlserve.weight_transfer.tcp import HEADER, MAGIC, FrameError, _recv_frame_into
    a, b = socket.socketpair()
    with a, b:
        buf = torch.zeros(1024, dtype=torch.uint8)
        guard = buf[1000:].clone()
        view = memoryview(buf.numpy())[:1000]
        for number, length, payload, fragment in [
            (0, 2000, b"x" * 2000, "carries 2000 bytes, 1000 were announced"),  # long: never read
            (1, 500, b"y" * 500, "carries 500 bytes, 1000 were announced"),  # short
            (7, 1000, b"z" * 1000, "expected frame #2, got frame #7"),
        ]:
            a.sendall(HEADER.pack(MAGIC, number, length) + payload)
            with pytest.raises(FrameError, match=fragment):
                _recv_frame_into(b, [0, 1, 2][number if number < 3 else 2], view)
            b.recv(len(payload))  # drop what was refused
        assert torch.equal(buf[1000:], guard) and int(buf[:1000].sum()) == 0  # nothing written
        a.sendall(b"GET / HTTP/1.1\r\n\r\n")
        with pytest.raises(FrameError, match="expected a frame header"):
            _recv_frame_into(b, 3, view)


def test_a_peer_that_resets_the_connection_reads_as_closed():
    """A peer that closes with bytes still unread sends a reset, not an end of stream; the
    receiver and the sender both report the peer as having closed the connection."""
    import struct

    from rlserve.weight_transfer.tcp import FrameError, _recv_exact, _send_frame
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        with client:
            client.sendall(b"unread")
            peer.settimeout(30)
            assert peer.recv(6, socket.MSG_PEEK) == b"unread"  # arrived, and left unread
            # Linger on with a zero timeout: close() resets the connection at once.
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            peer.close()
            assert select.select([client], [], [], 30)[0], "the reset never arrived"
            with pytest.raises(FrameError, match="the peer closed the connection"):
                _recv_exact(client, memoryview(bytearray(16)))
            with pytest.raises(FrameError, match="the peer closed the connection"):
                for _ in range(3):  # the first send after a reset may still be accepted
                    _send_frame(client, 0, b"x" * 65536)


def test_a_peer_that_closes_its_group_is_noticed_at_once():
    params = make_params()
    info = update_info(params)

    def send_later(g):
        time.sleep(0.5)
        GlooWeightTransferEngine.trainer_send_weights(iterator=params.items(), group=g)

    def close_later(g):
        time.sleep(0.5)
        g.close()

    started = time.monotonic()
    got = _in_threads(2, [lambda g: g.close()], TIMEOUT_S, send_later)  # the server re-inits elsewhere
    assert got[0][0] == "WeightTransferError" and "closed" in got[0][1]
    got = _in_threads(2, [lambda g: receive_weights(g, info, expected_params())], TIMEOUT_S, close_later)
    assert got[1][0] == "WeightTransferError" and "closed" in got[1][1]
    assert time.monotonic() - started < TIMEOUT_S  # neither waited for its timeout
