"""tuned_settings: a bounded probe once per device, then the JSON cache.

Two real probes on the test machine's disk (short budgets); the cache logic runs against a fake
``probe`` so it costs no I/O. Every test points ``$OFFLOAD_ZERO_CACHE`` into its tmp_path.
"""
import json
import os
import threading
import time

import pytest

from offload_zero.memory import tuning

SLACK_S = 0.6  # scheduling noise on a shared 2-core machine


@pytest.fixture(autouse=True)
def cache_file(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "aio_tuning.json"
    monkeypatch.setenv("OFFLOAD_ZERO_CACHE", str(path))
    return path


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "swap"
    path.mkdir()
    return path


@pytest.fixture
def fake_probe(monkeypatch):
    """Replace the probe by one that records its calls and answers (4 MiB, 32)."""
    calls = []

    def probe(folder, backend="auto", budget_s=2.0):
        calls.append((folder, backend, budget_s))
        trial = dict(block_size=4 << 20, queue_depth=32, write_gbps=1.0, read_gbps=1.0, gbps=1.0)
        return dict(block_size=4 << 20, queue_depth=32, backend="libaio",
                    measured=dict(trials=[trial], direct=True, trial_bytes=4 << 20))

    monkeypatch.setattr(tuning, "probe", probe)
    return calls


def test_real_probe_respects_budget_then_cache_serves(folder, cache_file):
    budget_s = 0.8
    start = time.perf_counter()
    got = tuning.tuned_settings(str(folder), budget_s=budget_s)
    elapsed = time.perf_counter() - start
    assert elapsed < budget_s + SLACK_S, got["measured"]
    assert got["source"] == "probe" and got["backend"] in ("libaio", "threads")
    assert got["block_size"] in tuning.BLOCK_SIZES and got["queue_depth"] in tuning.QUEUE_DEPTHS
    trials = got["measured"]["trials"]
    assert trials and (trials[0]["block_size"], trials[0]["queue_depth"]) == (1 << 20, 8)
    assert (got["block_size"], got["queue_depth"]) in {(t["block_size"], t["queue_depth"])
                                                       for t in trials}
    assert os.listdir(folder) == []  # the probe's files and folders are gone
    assert got["device"] == os.stat(folder).st_dev
    cached = json.loads(cache_file.read_text())["devices"][str(got["device"])]["auto"]
    assert (cached["block_size"], cached["queue_depth"]) == (got["block_size"], got["queue_depth"])

    start = time.perf_counter()
    again = tuning.tuned_settings(str(folder), budget_s=budget_s)
    assert time.perf_counter() - start < 0.1
    assert again["source"] == "cache"
    assert {k: again[k] for k in ("block_size", "queue_depth", "measured", "device")} == \
           {k: got[k] for k in ("block_size", "queue_depth", "measured", "device")}


def test_budget_too_small_gives_defaults_uncached(folder, cache_file, monkeypatch):
    monkeypatch.setattr(tuning, "CALIBRATION_BYTES", 1 << 20)
    got = tuning.tuned_settings(str(folder), backend="threads", budget_s=1e-3)
    assert got["source"] == "default" and got["measured"]["trials"] == []
    assert "budget" in got["measured"]["reason"]
    assert (got["block_size"], got["queue_depth"]) == (1 << 20, 8)
    assert not cache_file.exists()
    assert os.listdir(folder) == []


def test_second_call_served_from_cache(folder, fake_probe):
    first = tuning.tuned_settings(str(folder), budget_s=1.5)
    second = tuning.tuned_settings(str(folder), budget_s=1.5)
    assert [first["source"], second["source"]] == ["probe", "cache"]
    assert fake_probe == [(str(folder), "auto", 1.5)]
    assert (second["block_size"], second["queue_depth"]) == (4 << 20, 32)


def test_backends_and_devices_cached_apart(folder, cache_file, fake_probe):
    tuning.tuned_settings(str(folder))
    tuning.tuned_settings(str(folder), backend="threads")
    assert [c[1] for c in fake_probe] == ["auto", "threads"]
    data = json.loads(cache_file.read_text())
    device = str(os.stat(folder).st_dev)
    data["devices"] = {str(int(device) + 1): data["devices"][device]}  # another device only
    cache_file.write_text(json.dumps(data))
    assert tuning.tuned_settings(str(folder))["source"] == "probe"
    assert set(json.loads(cache_file.read_text())["devices"]) == {device, str(int(device) + 1)}


@pytest.mark.parametrize("content", [
    "{not json",
    "",
    "[1, 2]",
    json.dumps({"version": 99, "devices": {}}),
    json.dumps({"version": 1, "devices": []}),
    json.dumps({"version": 1, "devices": {"DEV": "x"}}),
    json.dumps({"version": 1, "devices": {"DEV": {"auto": {"block_size": 1000, "queue_depth": 8,
                                                           "measured": {}}}}}),
    json.dumps({"version": 1, "devices": {"DEV": {"auto": {"block_size": 4096, "queue_depth": 0,
                                                           "measured": {}}}}}),
])
def test_corrupt_cache_is_ignored_and_rewritten(folder, cache_file, fake_probe, content):
    cache_file.parent.mkdir()
    cache_file.write_text(content.replace("DEV", str(os.stat(folder).st_dev)))
    got = tuning.tuned_settings(str(folder))
    assert got["source"] == "probe" and len(fake_probe) == 1
    data = json.loads(cache_file.read_text())
    assert data["version"] == 1
    assert data["devices"][str(got["device"])]["auto"]["block_size"] == 4 << 20
    assert sorted(os.listdir(cache_file.parent)) == ["aio_tuning.json", "aio_tuning.json.lock"]
    assert tuning.tuned_settings(str(folder))["source"] == "cache"


def test_failing_probe_warns_and_is_not_cached(folder, cache_file, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tuning, "probe", broken)
    with pytest.warns(RuntimeWarning, match="probe under .* failed.*No space left"):
        got = tuning.tuned_settings(str(folder))
    assert got["source"] == "default" and (got["block_size"], got["queue_depth"]) == (1 << 20, 8)
    assert not cache_file.exists()


def test_unwritable_cache_warns_but_answers(folder, tmp_path, monkeypatch, fake_probe):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    monkeypatch.setenv("OFFLOAD_ZERO_CACHE", str(blocker / "sub" / "aio_tuning.json"))
    with pytest.warns(RuntimeWarning, match="cannot write the cache"):
        got = tuning.tuned_settings(str(folder))
    assert got["source"] == "probe" and got["block_size"] == 4 << 20


def test_concurrent_callers_probe_once(folder, monkeypatch, fake_probe):
    real_fake = tuning.probe

    def slow_probe(*args, **kwargs):
        time.sleep(0.2)
        return real_fake(*args, **kwargs)

    monkeypatch.setattr(tuning, "probe", slow_probe)
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        tuning.tuned_settings(str(folder))["source"])) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake_probe) == 1 and sorted(results) == ["cache", "cache", "probe"]


def test_cache_path_rules(tmp_path, monkeypatch):
    monkeypatch.setenv("OFFLOAD_ZERO_CACHE", str(tmp_path))  # an existing directory
    assert tuning.cache_path() == str(tmp_path / "aio_tuning.json")
    monkeypatch.setenv("OFFLOAD_ZERO_CACHE", str(tmp_path / "mine.json"))
    assert tuning.cache_path() == str(tmp_path / "mine.json")
    monkeypatch.delenv("OFFLOAD_ZERO_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuning.cache_path() == str(tmp_path / "xdg" / "offload-zero" / "aio_tuning.json")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tuning.cache_path() == str(tmp_path / "home" / ".cache" / "offload-zero" /
                                      "aio_tuning.json")


def test_pick_prefers_fewest_bytes_in_flight_among_ties():
    def trial(block_kb, queue_depth, gbps):
        return dict(block_size=block_kb << 10, queue_depth=queue_depth, gbps=gbps)

    assert tuning._pick([]) == (1 << 20, 8)
    assert tuning._pick([trial(1024, 8, 1.0), trial(4096, 32, 2.0)]) == (4 << 20, 32)
    # 4096 x 8 is within 3% of the best and has a quarter of its bytes in flight.
    assert tuning._pick([trial(4096, 32, 2.0), trial(4096, 8, 1.95), trial(256, 4, 1.0)]) == \
           (4 << 20, 8)


def test_candidates_cover_the_grid_defaults_first():
    pairs = tuning._candidates()
    assert pairs[0] == (1 << 20, 8) and len(pairs) == len(set(pairs)) == 9
    assert set(pairs) == {(b, q) for b in tuning.BLOCK_SIZES for q in tuning.QUEUE_DEPTHS}


@pytest.mark.parametrize("kwargs,needle", [
    (dict(backend="io_uring"), "'io_uring'"),
    (dict(budget_s=0), "budget_s.*0"),
    (dict(budget_s=float("inf")), "budget_s.*inf"),
    (dict(budget_s="2"), "budget_s.*'2'"),
])
def test_bad_arguments(folder, kwargs, needle, fake_probe):
    with pytest.raises(ValueError, match=needle):
        tuning.tuned_settings(str(folder), **kwargs)
    assert fake_probe == []


def test_missing_folder(tmp_path, fake_probe):
    with pytest.raises(ValueError, match="nope.*not an existing directory"):
        tuning.tuned_settings(str(tmp_path / "nope"))


def test_test_session_removes_its_tuning_cache_folder(tmp_path):
    """The suite points OFFLOAD_ZERO_CACHE at a fresh temp folder per session (never the user's
    cache) and removes that folder when the session ends."""
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "OFFLOAD_ZERO_CACHE"}
    env["TMPDIR"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        os.path.join(repo, "tests", "test_aligned.py")], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:]
    assert not list(tmp_path.glob("oz-tuning-*"))
