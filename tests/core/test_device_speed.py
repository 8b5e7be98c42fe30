"""The device's measured speed: real measurements on this CPU, the cache they land in and are read back from, the
aggregate over GEMM shapes, and the switch that turns it off."""

from __future__ import annotations

import json

import pytest
import torch

from flexengine.core import device_speed
from flexengine.core.device_speed import AttentionShape, Gemm, device_key, measure_device_speed

CPU = torch.device("cpu")
GEMMS = [Gemm(64, 64, 64, 2), Gemm(64, 128, 64)]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.delenv(device_speed.SPEED_ENV, raising=False)
    monkeypatch.setattr(device_speed, "MIN_TIMED_S", 0.005)  # quick: the test checks plumbing, not the machine
    path = tmp_path / "speed.json"
    monkeypatch.setenv(device_speed.CACHE_ENV, str(path))
    return path


def test_measures_this_cpu_and_reads_the_cache_back(cache, monkeypatch):
    speed = measure_device_speed(CPU, torch.float32, GEMMS, AttentionShape(2, 64, 16), optimizer_params=4096)
    assert speed is not None and speed.dtype_bytes == 4
    assert speed.matmul_tflops > 0 and speed.memory_gb_s > 0 and speed.attention_tflops > 0
    assert speed.optimizer_ns_per_param > 0 and speed.h2d_gb_s is None  # CPU: no host link
    assert str(cache) in speed.source and "measured on this machine" in speed.source
    entry = json.loads(cache.read_text())[device_key(CPU, torch.float32)]
    assert {"64x64x64", "64x128x64", "attn2x64x16", "memory_gb_s", "optimizer_ns_per_param"} <= set(entry)

    def never(*args):
        raise AssertionError("measured again although cached")

    for name in ("_gemm_tflops", "_attention_tflops", "_copy_gb_s", "_optimizer_ns"):
        monkeypatch.setattr(device_speed, name, never)
    again = measure_device_speed(CPU, torch.float32, GEMMS, AttentionShape(2, 64, 16), optimizer_params=4096)
    assert again == speed


def test_the_matmul_rate_is_total_flops_over_total_time(cache):
    key = device_key(CPU, torch.float32)
    cache.write_text(json.dumps({key: {"64x64x64": 1.0, "64x128x64": 4.0, "memory_gb_s": 3.0}}))
    speed = measure_device_speed(CPU, torch.float32, GEMMS)
    flops = {"64x64x64": 6 * 64**3 * 2, "64x128x64": 6 * 64 * 128 * 64}
    seconds = flops["64x64x64"] / 1e12 + flops["64x128x64"] / 4e12
    assert speed.matmul_tflops == pytest.approx(sum(flops.values()) / seconds / 1e12)
    assert speed.memory_gb_s == 3.0 and speed.attention_tflops is None and speed.optimizer_ns_per_param is None


def test_off_measures_nothing(cache, monkeypatch):
    monkeypatch.setenv(device_speed.SPEED_ENV, "off")
    assert measure_device_speed(CPU, torch.float32, GEMMS) is None
    assert not cache.exists()


def test_an_unreadable_cache_is_measured_again_and_rewritten(cache):
    cache.write_text("{not json")
    speed = measure_device_speed(CPU, torch.float32, GEMMS[:1])
    assert speed is not None and speed.matmul_tflops > 0
    assert device_key(CPU, torch.float32) in json.loads(cache.read_text())


def test_each_dtype_and_clock_has_its_own_entry(cache, monkeypatch):
    assert device_key(CPU, torch.float32) != device_key(CPU, torch.bfloat16)
    wall = device_key(CPU, torch.float32)
    monkeypatch.setenv(device_speed.CLOCK_ENV, "process")
    assert device_key(CPU, torch.float32) != wall and device_speed.clock() is device_speed.time.process_time


def test_the_log_says_so_before_measuring_and_the_buffers_are_released_after(cache, monkeypatch, caplog):
    events = []

    def gemm(g, device, dtype):
        events.append(("measure", any("measuring this device's speed (once; cached in" in m for m in caplog.messages)))
        return 1.0

    monkeypatch.setattr(device_speed, "_gemm_tflops", gemm)
    monkeypatch.setattr(device_speed, "release_measurement", lambda device: events.append(("release", device)))
    with caplog.at_level("INFO", logger=device_speed.__name__):
        measure_device_speed(CPU, torch.float32, GEMMS)
    assert events == [("measure", True), ("measure", True), ("release", CPU)]
    events.clear()
    measure_device_speed(CPU, torch.float32, GEMMS)  # cached: nothing measured, nothing to release
    assert events == []


def test_releasing_a_cuda_measurement_frees_its_cache_and_restarts_the_peak(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset_peak"))
    device_speed.release_measurement(CPU)
    assert calls == []
    device_speed.release_measurement(torch.device("cuda", 0))
    assert calls == ["empty_cache", "reset_peak"]  # freed first: the new peak starts from the run's own memory


def test_long_rows_and_a_whole_vocab_loss_are_measured_capped(cache, monkeypatch):
    """32K tokens: the block GEMMs run 4,096 rows; an unchunked loss (tokens x vocab) at most 64M outputs."""
    block, loss = Gemm(32768, 4096, 4096, 32), Gemm(32768, 152064, 4096, 1)
    assert block.measured_m == device_speed.GEMM_MAX_M and block.name == "4096x4096x4096"
    assert loss.measured_m * loss.n <= device_speed.GEMM_MAX_OUTPUT and loss.measured_m == (1 << 26) // 152064
    assert Gemm(64, 128, 64).measured_m == 64  # small shapes as they are
    shapes = []
    monkeypatch.setattr(torch, "randn", lambda *shape, **kw: shapes.append(shape) or torch.zeros(1, 1))
    monkeypatch.setattr(device_speed, "best_seconds", lambda fn, device: 1.0)
    device_speed._gemm_tflops(loss, CPU, torch.float32)
    m = loss.measured_m
    assert shapes == [(m, 4096), (4096, 152064), (m, 152064)]  # the tensors built are the capped ones


def test_measuring_leaves_the_global_generator_as_it_was(cache):
    """A run seeds torch, then measures (or reads) the speed, then builds its weights: the same weights either way."""
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    measure_device_speed(CPU, torch.float32, GEMMS, AttentionShape(2, 64, 16))  # cold: random operands drawn
    assert torch.equal(torch.rand(4), expected)
