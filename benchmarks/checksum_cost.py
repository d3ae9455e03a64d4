"""Device checksum throughput against a device-to-device copy of the same bucket (H200)."""
import torch
from rlserve.weight_transfer.checksum import checksum, checksum_into, host_checksum

dev = torch.device("cuda")
for mib in (64, 512, 2048):
    n = mib << 20
    buf = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
    out = torch.zeros(1, dtype=torch.int64, device=dev)
    dst = torch.empty_like(buf)
    assert checksum(buf) == host_checksum(buf.cpu().numpy())  # device and host agree
    def timed(fn, reps=10):
        fn(); torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record(); torch.cuda.synchronize()
        return a.elapsed_time(b) / reps
    c = timed(lambda: checksum_into(buf, out))
    cp = timed(lambda: dst.copy_(buf))
    print(f"bucket {mib} MiB: checksum {c:.3f} ms ({n / c / 1e6:.0f} GB/s read), "
          f"d2d copy {cp:.3f} ms ({2 * n / cp / 1e6:.0f} GB/s read+write)")
