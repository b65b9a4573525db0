"""The CUDA cross-check table (bench/cuda_published.json + bench/cuda_published.py): the data file is
complete and the scorer reports every row (analytic estimates; no GPU, no network)."""

from __future__ import annotations

import pytest

from memguard_testing.bench_scripts import load_bench_script

from memguard_core.estimator.cuda import CUDA_COUNTERS


@pytest.fixture(scope="module")
def cp():
    return load_bench_script("cuda_published")


@pytest.fixture(scope="module")
def data(cp):
    return cp.load()


@pytest.fixture(scope="module")
def results(cp, data):
    return cp.score(data)


def test_every_row_names_its_source_model_and_counter(data):
    cases = [r["case"] for r in data["rows"]]
    assert len(cases) == len(set(cases)) and len(cases) >= 20
    for src in data["sources"].values():
        for key in ("title", "url", "gpu", "software", "script", "counter", "counter_source", "unit"):
            assert src.get(key), key
        assert src["url"].startswith("https://")
    for r in data["rows"]:
        assert r["source"] in data["sources"] and r["model"] in data["models"]
        assert (r.get("counter") or data["sources"][r["source"]]["counter"]) in CUDA_COUNTERS
        assert r["measured_gb"] > 0 and r["method"] in ("full", "lora", "qlora")
        assert (r["method"] == "qlora") == bool(r.get("quantization"))
    for ns in data["not_scored"]:
        assert ns["source"] in data["sources"] and ns["why"]


def test_scorer_reports_each_row(cp, data, results):
    assert [r["case"] for r in results] == [r["case"] for r in data["rows"]]
    for res, row in zip(results, data["rows"]):
        unit = cp.UNIT_BYTES[data["sources"][row["source"]]["unit"]]
        assert res["measured"] == pytest.approx(row["measured_gb"] * unit)
        assert res["estimate"] > 0
        assert res["error"] == pytest.approx(res["estimate"] / res["measured"] - 1)
        assert res["within"] == (-0.05 <= res["error"] <= 0.25)
        kernel = "eager" if row.get("attn") == "eager" else "flash"  # bf16, head dims <= 256, no mask
        assert f"cuda: SDPA kernel {kernel}" in res["notes"]


def test_markdown_page_has_date_rows_and_sources(cp, data, results):
    md = cp.render_md(results, data, date="2026-11-25")
    assert "2026-11-25" in md
    for r in data["rows"]:
        assert f"| {r['case']} |" in md
    for src in data["sources"].values():
        assert src["url"] in md
    s = cp.summary(results)
    assert s["rows"] == len(results) and 0 <= s["within"] <= s["rows"]


def test_main_prints_without_writing(cp, capsys, tmp_path):
    out = tmp_path / "page.md"
    assert cp.main(["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "rows," in printed and out.exists()
