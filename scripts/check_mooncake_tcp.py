"""Mooncake's TCP transport as SGLang drives it, on one machine without a GPU.

Two TransferEngines initialized the way SGLang's MooncakeTransferEngine does
(P2PHANDSHAKE metadata, protocol "rdma", no device) with MC_FORCE_TCP=1; one
writes 1 MiB of host memory into the other over loopback. Exit 0 when the
bytes arrived intact.

    pip install mooncake-transfer-engine-non-cuda   # needs libibverbs1 (apt)
    python scripts/check_mooncake_tcp.py
"""

import ctypes
import os
import sys

os.environ["MC_FORCE_TCP"] = "1"
from mooncake.engine import TransferEngine

N = 1 << 20


def main() -> int:
    src = (ctypes.c_char * N)()
    dst = (ctypes.c_char * N)()
    ctypes.memmove(src, bytes(range(256)) * (N // 256), N)
    a, b = TransferEngine(), TransferEngine()
    for engine in (a, b):
        if engine.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") != 0:
            print("TransferEngine.initialize failed")
            return 1
    pa, pb = ctypes.addressof(src), ctypes.addressof(dst)
    if a.register_memory(pa, N) != 0 or b.register_memory(pb, N) != 0:
        print("register_memory failed")
        return 1
    ret = a.transfer_sync_write(f"127.0.0.1:{b.get_rpc_port()}", pa, pb, N)
    same = bytes(dst) == bytes(src)
    print(f"transfer_sync_write of {N} bytes -> {ret}; bytes equal: {same}")
    return 0 if ret == 0 and same else 1


if __name__ == "__main__":
    sys.exit(main())
