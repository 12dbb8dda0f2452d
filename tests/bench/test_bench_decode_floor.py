"""bench_decode_floor's arithmetic on the real default model: the bytes a decode step reads
(weights: the tied Q8_0 embedding read whole as the head; float32 KV per layer and token) and
a triad that reports a positive, finite bandwidth."""

from __future__ import annotations

import math

import pytest

from bench.bench_decode_floor import bandwidth, kv_bytes_read, weight_bytes_read

pytestmark = pytest.mark.real_model


def test_the_default_model_reads_every_weight_and_its_kv_per_step(real_engine):
    model = real_engine.runner.model
    assert model.lm_head is None  # tied: the head reads the whole embedding
    assert weight_bytes_read(real_engine, 1) == weight_bytes_read(real_engine, 8) == model.weight_bytes()
    per_token = 30 * 2 * 3 * 64 * 4  # 30 layers, K and V, 3 KV heads of 64, float32
    if real_engine.config.kv_cache_dtype in ("auto", "float32"):
        assert kv_bytes_read(real_engine, [100]) == 100 * per_token
        assert kv_bytes_read(real_engine, [100, 28]) == 128 * per_token


def test_the_triad_reports_a_bandwidth():
    bw = bandwidth(64, 2)  # 2 x L3-sized arrays: fast, still a real read and write
    assert math.isfinite(bw.triad_gbs) and bw.triad_gbs > 0.1 and bw.copy_gbs > 0.1
    assert bw.array_mib == 64 and bw.threads >= 1
