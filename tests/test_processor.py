"""The compute dtype by the processor (dflash_ray/processor.py): bf16 only where this CPU multiplies bf16
fast, measured once per machine and cached; a user's value wins; GPUs compute in bf16. Both outcomes are
forced through the cached measurement the runs read."""
from __future__ import annotations

import json

from dflash_ray.config import compose_config, compute_dtype_why
from dflash_ray.machine_cache import cache_root
from dflash_ray.processor import choose_cpu_dtype, cpu_compute_dtype, processor_key


def test_bf16_only_where_it_is_fast():
    assert choose_cpu_dtype(87.8, 210.6)[0] == "bfloat16"          # a 2-core AMD EPYC's AVX-512 BF16 (2.4x)
    dtype, why = choose_cpu_dtype(63.6, 1.1)                          # an AVX2-only processor (measured)
    assert dtype == "float32" and "no fast bf16" in why and "0.02x" in why
    assert choose_cpu_dtype(100.0, 110.0)[0] == "float32"            # 1.1x: not worth bf16's rounding


def test_measured_once_then_read_and_remeasured_when_unreadable(tmp_path):
    calls = []

    def measure(dtype):
        calls.append(dtype)
        return {"float32": 50.0, "bfloat16": 150.0}[dtype]

    assert cpu_compute_dtype(tmp_path, measure)[0] == "bfloat16" and calls == ["float32", "bfloat16"]
    assert cpu_compute_dtype(tmp_path, measure)[0] == "bfloat16" and len(calls) == 2   # cached
    (tmp_path / f"{processor_key()}.json").write_text("{not json")
    assert cpu_compute_dtype(tmp_path, measure)[0] == "bfloat16" and len(calls) == 4   # measured again


def force(fp32, bf16):
    path = cache_root() / "processor" / f"{processor_key()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"float32": fp32, "bfloat16": bf16}))


def test_the_config_answers_by_the_processor_unless_told(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_RAY_CACHE", str(tmp_path))   # this test's measurement record only
    real = ["model=smollm2_135m", "data=smol_prompts"]        # the real preset: compute_dtype null
    force(fp32=63.6, bf16=1.1)
    dtype, why = compute_dtype_why(compose_config(real))
    assert dtype == "float32" and "no fast bf16" in why
    force(fp32=60.0, bf16=240.0)
    assert compute_dtype_why(compose_config(real))[0] == "bfloat16"
    assert compute_dtype_why(compose_config([*real, "model.compute_dtype=float32"])) == ("float32", "model.compute_dtype")
    assert compute_dtype_why(compose_config([*real, "cluster=1gpu"]))[0] == "bfloat16"
    assert compute_dtype_why(compose_config([]))[0] == "float32"   # the embedded default: fp32 on every processor


def test_a_setting_that_holds_the_math_libraries_back_is_measured_on_its_own(monkeypatch):
    """ONEDNN_MAX_CPU_ISA=AVX2 on an AVX-512 BF16 processor makes torch compute bf16 itself, slowly: the
    measurement made without it must not answer for it."""
    for knob in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR"):
        monkeypatch.delenv(knob, raising=False)
    native = processor_key()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    held = processor_key()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert len({native, held, processor_key()}) == 3
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert processor_key() == native
