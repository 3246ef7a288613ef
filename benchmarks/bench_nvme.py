"""NVMe tier bandwidth: the offload-zero swapper beside fio, measured in the same run.

    python benchmarks/bench_nvme.py --path /mnt/nvme --size-mb 1024 --block-kb 1024 8192 \
        --queue-depth 8 [--backend auto] [--repeats 3] [--json]

For each block size: the swapper writes then reads one file of ``--size-mb`` MiB
(``measure_bandwidth``: O_DIRECT, ``--queue-depth`` requests in flight, best of ``--repeats``
passes, data verified), and, when ``fio`` is on PATH, fio runs the same sequential write and
read on the *same file* (ioengine=libaio, direct=1, same bs/iodepth/size), one fio pass
alternating with each of ours so both see the same extents and the same neighbours' noise. The
last column is ours as a percentage of fio. GB/s means 1e9 bytes per second.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offload_zero.memory.swapper import measure_bandwidth  # noqa: E402


def fio_peer(size_bytes: int, block_size: int, queue_depth: int):
    """A ``measure_bandwidth`` peer running one fio pass on the swapper's own file, or None
    when fio is not installed. Same file, extents, size, bs and iodepth as ours."""
    fio = shutil.which("fio")
    if fio is None:
        return None

    def run(file_path: str, op: str) -> float:
        cmd = [fio, "--name=oz", f"--filename={file_path}", f"--size={size_bytes}",
               f"--bs={block_size}", f"--iodepth={queue_depth}", "--ioengine=libaio",
               "--direct=1", f"--rw={op}", "--numjobs=1", "--output-format=json"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
        return job[op]["bw_bytes"] / 1e9

    return run


def fio_version() -> str | None:
    fio = shutil.which("fio")
    if fio is None:
        return None
    return subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", required=True, help="directory on the filesystem to measure")
    parser.add_argument("--size-mb", type=int, default=1024, help="file size, MiB")
    parser.add_argument("--block-kb", type=int, nargs="+", default=[1024],
                        help="request size(s), KiB (multiples of 4)")
    parser.add_argument("--queue-depth", type=int, default=8, help="requests in flight")
    parser.add_argument("--backend", default="auto", choices=("auto", "libaio", "threads"))
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per direction")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)

    size_bytes = args.size_mb << 20
    rows = []
    for block_kb in args.block_kb:
        for ring in (False, True):
            peer = fio_peer(size_bytes, block_kb << 10, args.queue_depth)
            ours = measure_bandwidth(args.path, size_bytes, block_kb << 10, args.queue_depth,
                                     backend=args.backend, repeats=args.repeats, peer=peer,
                                     ring=ring)
            rows.append(dict(block_kb=block_kb, ours=ours))
    version = fio_version()

    if args.json:
        print(json.dumps(dict(path=args.path, size_mb=args.size_mb, peer=version,
                              queue_depth=args.queue_depth, rows=rows), indent=2))
        return 0
    print(f"path={args.path} size={args.size_mb} MiB queue_depth={args.queue_depth} "
          f"repeats={args.repeats} per direction "
          f"(GB/s = 1e9 B/s)")
    header = (f"{'block':>8} {'buffer':>6} {'backend':>7} {'op':>5} {'ours best':>9} "
              f"{'median':>7} {'fio best':>9} {'median':>7} {'best/best':>9} {'med/med':>8}")
    print(header)
    print("-" * len(header))
    for row in rows:
        ours = row["ours"]
        for op in ("write", "read"):
            mine, mine_med = ours[f"{op}_gbps"], ours[f"{op}_gbps_median"]
            line = (f"{row['block_kb']:>6}KB {'ring' if ours['ring'] else 'file':>6} "
                    f"{ours['backend']:>7} {op:>5} {mine:9.3f} {mine_med:7.3f}")
            theirs_all = ours.get(f"peer_{op}_gbps_all")
            if theirs_all:
                best, med = max(theirs_all), statistics.median(theirs_all)
                line += (f" {best:9.3f} {med:7.3f} {100 * mine / best:8.1f}% "
                         f"{100 * mine_med / med:7.1f}%")
            else:
                line += f" {'n/a':>9} {'n/a':>7} {'n/a':>9} {'n/a':>8}"
            print(line)
    print("buffer: file = one buffer the size of the file (how the engine swaps); "
          "ring = queue_depth x block buffers reused (fio's footprint)")
    print(f"peer: {version or 'fio not installed'} (ioengine=libaio direct=1 sequential, "
          f"same file, passes alternating with ours)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
