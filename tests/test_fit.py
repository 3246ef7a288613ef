"""``offload-zero estimate`` with budgets: a verdict per placement ([Note: fit verdict]), sizes
on the command line, and its errors."""
import json
import os

import pytest
import torch

from offload_zero import cli, estimator
from offload_zero.activations import activation_bytes
from offload_zero.fit import decoder_shape, parse_bytes, shortfall

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["estimate", "--model", "tiny", "--batch-size", "2", "--seq-len", "64", "--json"]


@pytest.mark.parametrize("text,want", [("24GB", 24 * 10 ** 9), ("64GiB", 64 * 2 ** 30),
                                       ("1.5TB", 1_500_000_000_000), ("0", 0), ("512", 512),
                                       (" 2 mib ", 2 * 2 ** 20), ("100KB", 100_000)])
def test_sizes(text, want):
    assert parse_bytes(text, "--x") == want


@pytest.mark.parametrize("text", ["24XB", "-1GB", "GB", "", "1e9", "24 G B"])
def test_bad_size_names_the_value_and_the_forms(text):
    with pytest.raises(ValueError, match=f"--x {text!r} is not a size; give bytes.*GiB"):
        parse_bytes(text, "--x")


@pytest.mark.parametrize("text", ["0.5", "1.5", ".5"])
def test_a_bare_fraction_of_a_byte_is_refused_not_rounded_to_zero(text):
    with pytest.raises(ValueError, match=f"--x {text!r} is not a size: a bare number is whole "
                                         "bytes .a unit left out.*GiB"):
        parse_bytes(text, "--x")
    assert parse_bytes(text + "GB", "--x") == int(float(text) * 10 ** 9)


def _fit(capsys, *extra):
    assert cli.main(ARGS + list(extra)) == 0
    return json.loads(capsys.readouterr().out)


def test_need_is_the_table_plus_activations(capsys):
    data = _fit(capsys, "--host-memory", "1TB")
    acts = activation_bytes(decoder_shape("tiny"), 2, 64, torch.bfloat16)
    assert data["fit"]["activations"]["total"] == acts.total > 0
    rows = {(r["stage"], r["offload"]): r for r in data["table"]}
    assert len(data["fit"]["verdicts"]) == 9  # stages 1-3 x none/cpu/nvme
    for v in data["fit"]["verdicts"]:
        row = rows[(v["stage"], v["offload"])]
        assert v["need"] == {"device": row["device_bytes"] + acts.total,
                             "host": row["host_bytes"], "nvme": row["nvme_bytes"]}
        assert v["fits"] and v["unchecked"] == ["device", "nvme"]


def test_short_by_the_exact_bytes_on_each_tier(capsys):
    need = {(v["stage"], v["offload"]): v["need"]
            for v in _fit(capsys, "--host-memory", "1TB")["fit"]["verdicts"]}
    nvme = need[(3, "nvme")]
    budget = ["--gpu-memory", str(nvme["device"]), "--host-memory", str(nvme["host"] - 1),
              "--nvme-free", str(nvme["nvme"] - 7)]
    verdicts = {(v["stage"], v["offload"]): v for v in _fit(capsys, *budget)["fit"]["verdicts"]}
    assert verdicts[(3, "nvme")]["short"] == {"host": 1, "nvme": 7}
    for key, v in verdicts.items():  # every row: short exactly where need > budget
        want = {t: v["need"][t] - b for t, b in zip(
            ("device", "host", "nvme"), (nvme["device"], nvme["host"] - 1, nvme["nvme"] - 7))
            if v["need"][t] > b}
        assert v["short"] == want and v["fits"] == (not want), key
    assert verdicts[(3, "none")]["short"]["device"] > 0  # (the states and the whole batch)
    enough = ["--gpu-memory", str(nvme["device"]), "--host-memory", str(nvme["host"]),
              "--nvme-free", str(nvme["nvme"])]
    verdicts = {(v["stage"], v["offload"]): v for v in _fit(capsys, *enough)["fit"]["verdicts"]}
    assert verdicts[(3, "nvme")]["fits"] and verdicts[(3, "nvme")]["short"] == {}


def test_checkpointing_lowers_the_device_need(capsys):
    plain = _fit(capsys, "--gpu-memory", "1TB")["fit"]
    ckpt = _fit(capsys, "--gpu-memory", "1TB", "--activation-checkpointing")["fit"]
    want = activation_bytes(decoder_shape("tiny"), 2, 64, torch.bfloat16, True)
    assert ckpt["activations"]["total"] == want.total < plain["activations"]["total"]
    assert [a["need"]["device"] - b["need"]["device"] for a, b in
            zip(plain["verdicts"], ckpt["verdicts"])] == \
        [plain["activations"]["total"] - want.total] * 9


def test_cpu_device_checks_device_and_host_together(capsys):
    data = _fit(capsys, "--cpu-device", "--host-memory", "1TB")
    v = next(v for v in data["fit"]["verdicts"] if (v["stage"], v["offload"]) == (3, "cpu"))
    total = v["need"]["device"] + v["need"]["host"]
    data = _fit(capsys, "--cpu-device", "--host-memory", str(total - 5))
    v = next(v for v in data["fit"]["verdicts"] if (v["stage"], v["offload"]) == (3, "cpu"))
    assert v["short"] == {"device+host": 5}
    assert shortfall({"device": 3, "host": 4, "nvme": 9},
                     {"shared": True, "host": 7, "nvme": None}) == {}


def test_table_lines(capsys):
    assert cli.main(["estimate", "--params", "7e9", "--gpu-memory", "24GB", "--host-memory",
                     "64GB", "--nvme-free", "500GB", "--batch-size", "4", "--seq-len",
                     "2048", "--activation-checkpointing"]) == 0
    text = capsys.readouterr().out
    assert "will it fit (GB): --gpu-memory 24.0, --host-memory 64.0, --nvme-free 500.0" in text
    lines = [line.split() for line in text.splitlines()[-9:]]
    assert [(int(w[0]), w[1]) for w in lines] == [(s, o) for s in (1, 2, 3)
                                                 for o in ("none", "cpu", "nvme")]
    verdict = {(w[0], w[1]): " ".join(w[5:]) for w in lines}
    assert verdict[("3", "nvme")] == "fits"
    assert verdict[("1", "none")].startswith("short by ") and "on device" in verdict[("1", "none")]


def _cli(*args):
    from dist_harness import run_cli
    return run_cli(args, REPO, timeout=120)


def test_bad_size_is_one_line_naming_the_value():
    r = _cli("estimate", "--params", "7e9", "--gpu-memory", "24XB")
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1
    assert "argument --gpu-memory: '24XB' is not a size" in r.stderr
    assert "KiB, MiB, GiB, TiB" in r.stderr and "24GB" in r.stderr


@pytest.mark.parametrize("args,message", [
    (["--host-memory", "64GB"], "--batch-size and --seq-len are both needed"),
    (["--batch-size", "2"], "--batch-size and --seq-len are both needed"),
    (["--cpu-device", "--gpu-memory", "8GB", "--batch-size", "1", "--seq-len", "8"],
     "--gpu-memory 8000000000 with --cpu-device"),
    (["--batch-size", "0", "--seq-len", "8"], "batch_size=0 is not valid"),
])
def test_flag_errors(capsys, args, message):
    assert cli.main(["estimate", "--params", "1e9"] + args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_model_the_formula_does_not_cover(tmp_path, capsys):
    from transformers import GPT2Config
    GPT2Config(n_layer=2, n_embd=32, n_head=2).save_pretrained(tmp_path)
    assert cli.main(["estimate", "--model", str(tmp_path), "--batch-size", "1", "--seq-len",
                     "8", "--gpu-memory", "1GB"]) == 2
    assert "activations of GPT2Config are not estimated" in capsys.readouterr().err


def test_placement_shortfall_per_rank_and_per_node():
    """What offload="auto" calls: per rank by default, per node on request."""
    from offload_zero.fit import placement_shortfall
    est = estimator.estimate_memory(2e9, world_size=2, gpus_per_node=2)
    p = est.placement(3, "nvme")
    budgets = {"device": p.device_bytes + 99, "host": p.host_bytes_per_rank,
               "nvme": p.nvme_bytes_per_rank, "shared": False}
    need, short = placement_shortfall(p, budgets, activations=100)
    assert need == {"device": p.device_bytes + 100, "host": p.host_bytes_per_rank,
                    "nvme": p.nvme_bytes_per_rank} and short == {"device": 1}
    need, short = placement_shortfall(p, budgets, activations=99, per_node=True)
    assert need["host"] == 2 * p.host_bytes_per_rank > 0
    assert short == {"host": p.host_bytes_per_rank, "nvme": p.nvme_bytes_per_rank}
