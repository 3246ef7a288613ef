"""``offload-zero bench nvme``: JSON and table output, bad values exit 2 with one line."""
import json
import os

import pytest

from dist_harness import run_cli
from offload_zero import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(*argv):
    return run_cli(["bench", "nvme", *argv], REPO, timeout=120)


def test_json_subprocess(tmp_path):
    out = _bench("--path", str(tmp_path), "--size-mb", "16", "--block-kb", "256",
                 "--queue-depth", "4", "--backend", "threads", "--repeats", "1", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["target"] == "nvme" and data["path"] == str(tmp_path)
    assert data["size_bytes"] == 16 << 20 and data["block_size"] == 256 << 10
    assert data["queue_depth"] == 4 and data["backend"] == "threads"
    assert data["read_gbps"] > 0 and data["write_gbps"] > 0
    assert len(data["read_s"]) == len(data["write_s"]) == 1
    assert os.listdir(tmp_path) == []  # the bench folder is gone


def test_bad_value_subprocess_exits_2_with_one_line(tmp_path):
    out = _bench("--path", str(tmp_path), "--size-mb", "0")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        "offload-zero bench: error: --size-mb 0 is not valid; it must be >= 1 (MiB)"]


def test_table_in_process(tmp_path, capsys):
    assert cli.main(["bench", "nvme", "--path", str(tmp_path), "--size-mb", "4",
                     "--block-kb", "1024", "--queue-depth", "2", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"nvme bench on {tmp_path}: ")
    assert "file 4 MiB, block 1024 KiB, queue depth 2, 1 passes" in text
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines()
            if line.strip().split()[:1] in (["write"], ["read"])}
    assert set(rows) == {"write", "read"} and all(float(v[0]) > 0 for v in rows.values())
    assert "GB/s = 1e9 bytes/s" in text


@pytest.mark.parametrize("argv,needle", [
    (["--size-mb", "0"], "--size-mb 0 "),
    (["--size-mb", "-3"], "--size-mb -3 "),
    (["--block-kb", "6"], "--block-kb 6 "),
    (["--block-kb", "0"], "--block-kb 0 "),
    (["--queue-depth", "0"], "--queue-depth 0 "),
    (["--repeats", "0"], "--repeats 0 "),
])
def test_bad_values(tmp_path, capsys, argv, needle):
    assert cli.main(["bench", "nvme", "--path", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    assert os.listdir(tmp_path) == []


def test_missing_path(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert cli.main(["bench", "nvme", "--path", str(missing), "--size-mb", "1"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"offload-zero bench: error: --path {str(missing)!r} is not an " \
                          f"existing directory"


def test_path_flag_required(capsys):
    with pytest.raises(SystemExit) as exc_info:
        cli.main(["bench", "nvme", "--size-mb", "1"])
    assert exc_info.value.code == 2 and "--path" in capsys.readouterr().err
