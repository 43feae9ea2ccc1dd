"""benchmarks/common.py's record of the machine a benchmark ran on, read from this machine's /proc/cpuinfo."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import common  # noqa: E402

from lightning_grpo.models.dtype_probe import ISA_CAPS  # noqa: E402

CPUINFO = Path("/proc/cpuinfo")


@pytest.mark.skipif(not CPUINFO.exists(), reason="needs Linux's /proc/cpuinfo")
def test_the_record_carries_the_cpus_family_and_model_numbers_as_cpuinfo_gives_them():
    fields = dict(line.split(":", 1) for line in CPUINFO.read_text().splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    record = common.cpu()
    if fields.get("cpu family", "").isdigit():
        assert record["family"] == int(fields["cpu family"]) and record["model_number"] == int(fields["model"])
    else:  # e.g. an ARM host: no numbers rather than wrong ones
        assert "family" not in record and "model_number" not in record
    assert record["model"] == fields.get("model name", record["model"])
    assert set(record["flags"]) <= set(common.CPU_FLAGS)


def test_the_record_names_the_caps_on_the_instructions_only_where_the_environment_sets_them(monkeypatch):
    for name in ISA_CAPS:
        monkeypatch.delenv(name, raising=False)
    assert "isa_caps" not in common.cpu() and common.provenance("python x.py")["command"] == "python x.py"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert common.cpu()["isa_caps"] == "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2"
    assert common.provenance("python benchmarks/roofline.py")["command"] == (
        "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/roofline.py"
    )  # the command repeats them
