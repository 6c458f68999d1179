"""Issue #34, class 6: the server never follows a link it was not given. Links already in an output
folder are refused before any work (nothing lands outside it), and ``server-kit report`` reads only
regular files inside the run directory, bounded before they are read, and draws no number past range."""

import io
import json
import os

import numpy as np
import pytest
from PIL import Image

from common.errors import ConfigError, DataError
from server_kit.aggregate import aggregate
from server_kit.aggregate_config import AggregateConfig
from server_kit.federation.simulate import SimulateConfig, simulate
from server_kit.report.html import REPORT_FILE, read_run, write_report


def test_aggregate_refuses_a_linked_work_folder_before_any_work(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    for name in ("synthetic", "generator"):
        (out / name).symlink_to(elsewhere, target_is_directory=True)
        with pytest.raises(ConfigError, match="symbolic link"):
            aggregate([tmp_path / "missing.bundle"], out, config=AggregateConfig())
        (out / name).unlink()
    assert sorted(os.listdir(out)) == [] and sorted(os.listdir(elsewhere)) == []


def test_simulate_refuses_a_linked_subfolder_before_any_work(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "run"
    out.mkdir()
    (out / "clients").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ConfigError, match="symbolic link"):
        simulate(SimulateConfig(dataset="digits", out_dir=out, num_clients=2, progress=False))
    assert os.listdir(out) == ["clients"] and os.listdir(elsewhere) == []


def png() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def run(tmp_path):
    run = tmp_path / "run"
    (run / "server").mkdir(parents=True)
    results = {"config": {"dataset": "digits"}, "seed": 0, "global_accuracy": 0.5, "started_at": 1.7e9}
    (run / "results.json").write_text(json.dumps(results))
    (run / "server" / "report.json").write_text(json.dumps({"distill_loss": [2.0, 1.0], "accuracy": 0.5}))
    (run / "server" / "pseudo_images.png").write_bytes(png())
    return run


def page(run) -> str:
    return write_report(run).read_text()


def test_an_honest_hand_made_run_reads_its_grid(run):
    assert "pseudo_images.png" in read_run(run).grids
    assert "<h1>" in page(run)


def test_a_grid_linked_from_outside_the_run_is_not_read(run, tmp_path):
    outside = tmp_path / "outside.png"
    outside.write_bytes(png())
    (run / "server" / "pseudo_images.png").unlink()
    (run / "server" / "pseudo_images.png").symlink_to(outside)
    assert "pseudo_images.png" not in read_run(run).grids
    assert "<h1>" in page(run)


@pytest.mark.parametrize("what", ["results_link", "server_link", "sparse", "fifo", "deep", "utf8"])
def test_hostile_run_files_are_refused_and_nothing_is_written(run, tmp_path, what):
    results = run / "results.json"
    if what == "results_link":
        (tmp_path / "secret.json").write_text(results.read_text())
        results.unlink()
        results.symlink_to(tmp_path / "secret.json")
    elif what == "server_link":
        (run / "server").rename(tmp_path / "server")
        (run / "server").symlink_to(tmp_path / "server", target_is_directory=True)
    elif what == "sparse":  # 1 GB on paper, nothing on disk: refused from its size, never read
        with open(results, "wb") as fh:
            fh.truncate(1 << 30)
    elif what == "fifo":  # opening it for reading would wait for a writer forever
        results.unlink()
        os.mkfifo(results)
    elif what == "deep":
        (run / "server" / "report.json").write_text("[" * 5000 + "]" * 5000)
    else:
        results.write_bytes(b'{"config": "\xff"}')
    with pytest.raises(DataError):
        write_report(run)
    assert not (run / REPORT_FILE).exists()


@pytest.mark.parametrize("value", [1e308, -1e308, 2**63, 10**19])
def test_values_past_any_drawable_range_are_not_drawn(run, value):
    results = json.loads((run / "results.json").read_text())
    results.update(global_accuracy=value, started_at=value, seconds={"total": value, "server": value})
    results["clients"] = [{"index": 0, "test_accuracy": value}]
    (run / "results.json").write_text(json.dumps(results))
    (run / "server" / "report.json").write_text(json.dumps({"distill_loss": [value, 1.0], "accuracy": value}))
    assert "<h1>" in page(run)
