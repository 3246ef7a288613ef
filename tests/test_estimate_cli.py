"""``offload-zero estimate``: JSON with the ZeRO paper's figures, a readable table, flag errors."""
import json
import os

import pytest

from offload_zero import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _row_states(data, stage, offload="none"):
    row = next(r for r in data["table"] if r["stage"] == stage and r["offload"] == offload)
    return row["model_state_bytes_per_device"]


def test_json_subprocess_gives_the_paper_numbers():
    from dist_harness import run_cli
    run = run_cli(["estimate", "--params", "7.5e9", "--gpus", "64", "--json"], REPO, timeout=120)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    data = json.loads(out)
    assert data["world_size"] == 64 and data["units"] == "bytes"
    got = [f"{_row_states(data, s) / 1e9:.1f}" for s in (0, 1, 2, 3)]
    assert got == ["120.0", "31.4", "16.6", "1.9"]
    assert data["selected"]["stage"] == 3 and data["selected"]["offload"] == "none"


def test_trillion_parameters_on_1024_ranks(capsys):
    assert cli.main(["estimate", "--params", "1e12", "--gpus", "8", "--nodes", "128",
                     "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["nodes"] == 128 and data["world_size"] == 1024
    assert f"{data['selected']['model_state_bytes_per_device'] / 1e9:.1f}" == "15.6"


def test_table_prints_every_stage_and_offload(capsys):
    assert cli.main(["estimate", "--params", "7.5e9", "--gpus", "64", "--stage", "2",
                     "--offload", "cpu"]) == 0
    text = capsys.readouterr().out
    for header in ("states/dev", "extra/dev", "total/dev", "host/node", "NVMe/node"):
        assert header in text
    rows = [line for line in text.splitlines() if line[:2].strip() in ("", "*")
            and len(line.split()) >= 7 and line.split()[-6] in ("none", "cpu", "nvme")]
    assert len(rows) == 12
    marked = [r for r in rows if r.startswith("*")]
    assert len(marked) == 1 and marked[0].split()[1:3] == ["2", "cpu"]
    first = {r.split()[-7]: r.split()[-5] for r in rows if r.split()[-6] == "none"}
    assert first == {"0": "120.0", "1": "31.4", "2": "16.6", "3": "1.9"}


def test_preset_model_in_megabytes(capsys):
    assert cli.main(["estimate", "--model", "tiny", "--unit", "MB", "--dtype", "fp32"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("preset tiny") and "MB = 1e6 bytes" in text


def test_cpu_device_estimate_equals_a_cpu_only_run(capsys, tmp_path):
    """--cpu-device: the estimate of a CPU-only run, equal to what the engine reports (the fp32
    master offloaded to the host is the shard's own memory there)."""
    import torch
    from offload_zero import OffloadEngine
    from offload_zero.train import build_model, add_arguments
    import argparse
    assert cli.main(["estimate", "--model", "tiny", "--dtype", "fp32", "--offload", "cpu",
                     "--json", "--cpu-device"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert cli.main(["estimate", "--model", "tiny", "--dtype", "fp32", "--offload", "cpu",
                     "--json"]) == 0
    accel = json.loads(capsys.readouterr().out)
    p = argparse.ArgumentParser()
    add_arguments(p)
    model, _, _ = build_model(p.parse_args(["--preset", "tiny"]))
    with OffloadEngine(model, stage=3, offload="cpu") as eng:
        x = torch.randint(0, 100, (2, 8))
        eng.backward(eng(input_ids=x, labels=x).loss)
        eng.step()
        rep = eng.memory_report()
    sel, other = data["selected"], accel["selected"]
    assert sel["model_states"]["host"]["master_weights"] == 0 < other["model_states"]["host"]["master_weights"]
    for tier in ("device", "host", "nvme"):
        for kind, v in sel["model_states"][tier].items():
            assert rep[tier]["by_kind"][kind]["peak_bytes"] == v + sel["extras"][tier][kind], (tier, kind)


@pytest.mark.parametrize("argv,needle", [
    (["--params", "-5"], "-5"), (["--params", "1e9", "--gpus", "0"], "--gpus 0"),
    (["--model", "no-such-preset"], "no-such-preset"),
    (["--params", "1e9", "--prefetch", "-1"], "prefetch=-1")])
def test_bad_values_exit_2_with_one_line(argv, needle, capsys):
    assert cli.main(["estimate", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("offload-zero estimate: error:") and needle in err


def test_bad_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["estimate", "--params", "1e9", "--stage", "5"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        cli.main(["estimate"])  # --params or --model is required
    capsys.readouterr()


def test_an_absurd_parameter_count_is_refused_at_once(capsys):
    """--params 1e30 used to build one layout row per assumed layer (1.7e8 of them) until the
    kernel killed the process for memory; the largest count taken (1e15) prints a readable
    table in seconds, the next one up is refused by name, as is an API layout of too many
    units."""
    from offload_zero.estimator import MAX_PARAMS, MAX_UNITS, estimate_memory
    assert cli.main(["estimate", "--params", f"{MAX_PARAMS:.0e}"]) == 0
    table = capsys.readouterr().out
    rows = [line.split() for line in table.splitlines() if line[:3] in ("  0", "* 3", "  3")]
    assert rows and all(len(r) >= 7 for r in rows)  # columns still apart
    for count in ("1e16", "1e30"):
        assert cli.main(["estimate", "--params", count]) == 2
        err = capsys.readouterr().err
        assert f"number of parameters {float(count)!r} is not valid; it must be at most" in err
    with pytest.raises(ValueError, match=rf"largest_unit_numel=1 cuts .* at most {MAX_UNITS}"):
        estimate_memory(10 ** 12, largest_unit_numel=1)


def test_an_interrupted_estimate_says_nothing_of_swap_files(capsys, monkeypatch):
    """estimate writes no files: Ctrl-C or SIGTERM ends it without claiming swap files were
    removed (train's and bench's messages keep saying so)."""
    from offload_zero import estimator

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(estimator, "run", interrupted)
    assert cli.main(["estimate", "--params", "1e9"]) == 130
    err = capsys.readouterr().err
    assert "interrupted (Ctrl-C)" in err and "swap" not in err


def test_master_dtype_flag(capsys):
    """--master-dtype bf16 (with the default --dtype bf16): 2 bytes of master weights per
    parameter instead of 4 wherever the master is not the shard itself; with --dtype fp32 a
    one-line error."""
    rows = {}
    for flags in ([], ["--master-dtype", "bf16"]):
        assert cli.main(["estimate", "--params", "1e9", "--json", *flags]) == 0
        data = json.loads(capsys.readouterr().out)
        rows[tuple(flags)] = next(r for r in data["table"]
                                  if r["stage"] == 3 and r["offload"] == "cpu")
    fp32, bf16 = (r["model_states"]["host"]["master_weights"] for r in rows.values())
    assert fp32 == 2 * bf16 == 4 * 10 ** 9
    assert cli.main(["estimate", "--params", "1e9", "--dtype", "fp32", "--master-dtype",
                     "bf16"]) == 2
    assert "master_dtype='bf16' needs dtype bf16" in capsys.readouterr().err
    # no verdict for a placement the engine refuses: the state on the GPU with bf16 masters
    assert cli.main(["estimate", "--params", "1e9", "--master-dtype", "bf16", "--gpu-memory",
                     "80GB", "--host-memory", "500GB", "--nvme-free", "1TB", "--batch-size",
                     "1", "--seq-len", "512"]) == 0
    out = capsys.readouterr().out
    verdicts = out.split("will it fit")[1]
    assert "none" not in verdicts and verdicts.count("fits") == 6
    assert "the none rows, for reference: bf16 masters" in out
    assert "states: parameters, gradients, bf16 master weights and Adam moments" in out


def test_moment_dtype_and_host_cache_flags(capsys):
    """--moment-dtype bf16: 8 bytes of optimizer state per parameter in the NVMe rows instead
    of 12 (the paper's unpadded arithmetic), int8: 4 + 2 there and the absmax in host memory; --host-cache-bytes moves that many bytes of it
    (whole flat parameters, at most) from NVMe to host memory."""
    rows = {}
    for flags in ([], ["--moment-dtype", "bf16"], ["--moment-dtype", "int8"],
                  ["--host-cache-bytes", str(3 * 10 ** 9)]):
        assert cli.main(["estimate", "--params", "1e9", "--json", *flags]) == 0
        data = json.loads(capsys.readouterr().out)
        rows[tuple(flags)] = next(r for r in data["table"]
                                  if r["stage"] == 3 and r["offload"] == "nvme")
    fp32, bf16 = rows[()], rows[("--moment-dtype", "bf16")]
    cached = rows[("--host-cache-bytes", str(3 * 10 ** 9))]
    opt = lambda r: r["model_states"]["nvme"]["master_weights"] + r["model_states"]["nvme"]["moments"]  # noqa: E731
    assert 2 * fp32["model_states"]["nvme"]["moments"] == 4 * bf16["model_states"]["nvme"]["moments"]
    int8 = rows[("--moment-dtype", "int8")]["model_states"]
    assert 4 * int8["nvme"]["moments"] == fp32["model_states"]["nvme"]["moments"]
    # (each block of 256's two fp32 absmax stay in host memory: 8 bytes a block)
    scales = int8["host"]["moments"] - fp32["model_states"]["host"]["moments"] // 4
    assert scales == pytest.approx(10 ** 9 * 8 / 256, rel=1e-3)
    moved = opt(fp32) - opt(cached)
    assert 0 < moved <= 3 * 10 ** 9
    assert cached["host_bytes_per_rank"] > fp32["host_bytes_per_rank"]
