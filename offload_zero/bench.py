"""``offload-zero bench nvme``: the swapper's sequential read and write bandwidth on one file.

A thin command over :func:`offload_zero.memory.swapper.measure_bandwidth`: one swap file of
``--size-mb`` MiB in a fresh sub-folder of ``--path`` is written ``--repeats`` times from an
aligned host buffer, then read back ``--repeats`` times and checked, with ``--block-kb`` KiB
per request and ``--queue-depth`` requests in flight. The best and the median pass per
direction are printed in GB/s (1e9 bytes per second). The sub-folder is removed afterwards.
For the same figures beside fio see ``benchmarks/bench_nvme.py``.
"""
from __future__ import annotations

import argparse
import json
import os

from offload_zero.memory.swapper import measure_bandwidth
from offload_zero.tables import AIO_BACKENDS as BACKENDS

__all__ = ["DESCRIPTION", "add_arguments", "run", "TARGETS"]

TARGETS = ("nvme",)
"""What ``offload-zero bench`` can measure: ``nvme`` is the swapper's file bandwidth."""

DESCRIPTION = """\
Measure the NVMe tier: write then read one file of --size-mb MiB under --path with the
swapper (O_DIRECT, --block-kb KiB per request, --queue-depth requests in flight), --repeats
passes per direction, data verified. Prints the best and median GB/s (1e9 bytes/s) per
direction. The file lives in a fresh sub-folder of --path and is removed afterwards.

examples:
  offload-zero bench nvme --path /mnt/nvme --size-mb 1024
  offload-zero bench nvme --path /tmp --size-mb 64 --block-kb 4096 --queue-depth 32 --json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``offload-zero bench``."""
    parser.add_argument("target", choices=TARGETS, help="what to measure (nvme: swap files)")
    parser.add_argument("--path", required=True, metavar="DIR",
                        help="an existing, writable directory on the filesystem to measure")
    parser.add_argument("--size-mb", type=int, default=256, metavar="N",
                        help="file size in MiB (default 256); the host buffer is as large")
    parser.add_argument("--block-kb", type=int, default=1024, metavar="K",
                        help="bytes per request in KiB, a multiple of 4 (default 1024)")
    parser.add_argument("--queue-depth", type=int, default=8, metavar="Q",
                        help="requests in flight (default 8)")
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="auto: libaio when usable, else a thread pool (default auto)")
    parser.add_argument("--repeats", type=int, default=3, metavar="R",
                        help="timed passes per direction (default 3)")
    parser.add_argument("--json", action="store_true",
                        help="print the measurement as JSON (sizes in bytes, times in s)")


def _check_args(args: argparse.Namespace) -> None:
    """Raise ValueError with a one-line message naming the first bad flag value."""
    if args.size_mb < 1:
        raise ValueError(f"--size-mb {args.size_mb} is not valid; it must be >= 1 (MiB)")
    if args.block_kb < 4 or args.block_kb % 4:
        raise ValueError(f"--block-kb {args.block_kb} is not valid; it must be a positive "
                         f"multiple of 4 (KiB), the O_DIRECT alignment")
    if args.queue_depth < 1:
        raise ValueError(f"--queue-depth {args.queue_depth} is not valid; it must be >= 1")
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats} is not valid; it must be >= 1")
    if not os.path.isdir(args.path):
        raise ValueError(f"--path {args.path!r} is not an existing directory")
    from offload_zero.config import require_writable
    require_writable(args.path, f"--path {args.path!r}", "give a folder this process can write to")


def format_result(result: dict, path: str) -> str:
    """The human-readable report of one ``measure_bandwidth`` result (GB/s = 1e9 bytes/s)."""
    mode = "O_DIRECT" if result["direct"] else "page cache (no O_DIRECT)"
    lines = [
        f"nvme bench on {path}: {result['backend']} backend, {mode}, file "
        f"{result['size_bytes'] >> 20} MiB, block {result['block_size'] >> 10} KiB, queue depth "
        f"{result['queue_depth']}, {len(result['write_s'])} passes per direction",
        f"  {'op':<5} {'best GB/s':>9} {'median GB/s':>11}",
    ]
    for op in ("write", "read"):
        lines.append(f"  {op:<5} {result[f'{op}_gbps']:9.3f} {result[f'{op}_gbps_median']:11.3f}")
    lines.append("GB/s = 1e9 bytes/s")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict:
    """Run ``offload-zero bench``: measure, print a table (or JSON), return the result dict.

    Raises:
        ValueError: a bad flag value (size < 1 MiB, block not a multiple of 4 KiB, queue depth
            or repeats < 1, path not an existing writable directory), or a backend that cannot
            work there (see ``Swapper``).
        SwapIOError: an I/O failure while measuring (e.g. no space left for the file).
    """
    _check_args(args)
    result = measure_bandwidth(args.path, args.size_mb << 20, block_size=args.block_kb << 10,
                               queue_depth=args.queue_depth, backend=args.backend,
                               repeats=args.repeats)
    result = dict(target=args.target, path=os.path.abspath(args.path), units="GB/s = 1e9 B/s",
                  **result)
    print(json.dumps(result, indent=2) if args.json else format_result(result, result["path"]))
    return result
