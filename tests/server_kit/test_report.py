"""report.html of a tiny simulated federation: written beside results.json, self-contained, every figure
drawn where the run has its data (a note where not), every string from the run escaped, and every image
loaded by a real browser (headless Chromium, skipped where none is installed)."""

import base64
import html
import io
import json
import re
import shutil
import subprocess

import pytest
from PIL import Image

from common.errors import DataError
from server_kit.cli import main
from server_kit.report.figures import MAX_NAMED_LINES, clients_curve_figure
from server_kit.report.html import MAX_DEVICE_REPORT_BYTES, REPORT_FILE, device_curves, read_run, write_report

TINY = [
    "simulate", "--dataset", "digits", "--num-clients", "2", "--alpha", "1.0", "--seed", "0", "--quiet",
    "--profiles", "laptop-cpu,raspberry-pi-4-4gb", "--particles", "2", "--iterations", "1",
    "--final-epochs", "3", "--cvae-epochs", "2", "--inversion-samples-per-teacher", "50",
    "--inversion-steps", "5",
    "--generator-steps", "5", "--generator-samples", "100", "--decoder-samples", "200",
    "--distill-epochs", "3", "--aggregate-device", "cpu", "--synth", "inversion,generator,decoder",
]  # fmt: skip
# what the tiny run records: every figure but the phases it does not run (fusion, adversarial rounds) and
# personalization (not part of a simulate run); its sources are named, so the generator runs although the
# decoders hold every class
RUN_FIGURES = {
    "partition", "clients", "per-class", "loss-search", "loss-classifier", "loss-cvae", "loss-distill",
    "loss-generator", "grid-pseudo-images", "grid-decoder-samples", "grid-decoder-samples-filtered", "phases",
}  # fmt: skip
PERSONAL = {"personal", "loss-personalize"}
EVERY_FIGURE = RUN_FIGURES | {"loss-fusion", "loss-adversarial"} | PERSONAL
DATA_URI = re.compile(r"data:image/png;base64,([A-Za-z0-9+/=]+)")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    assert main([*TINY, "--out", str(out)]) == 0
    return out


def copy_run(run, dst):
    """The run's JSON reports and PNG grids (what the report reads), without the models and data."""
    ignore = shutil.ignore_patterns("*.npz", "*.bundle", "*.onnx", "synthetic", "generator", REPORT_FILE)
    return shutil.copytree(run, dst, ignore=ignore)


def edit_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def figures(page):
    return set(re.findall(r'<figure id="fig-([a-z-]+)"', page))


def notes(page):
    return set(re.findall(r'<p class="note" id="note-([a-z-]+)"', page))


def test_simulate_writes_a_self_contained_report_beside_results(run):
    page = (run / REPORT_FILE).read_text()
    assert (run / "results.json").is_file()
    assert figures(page) == RUN_FIGURES
    assert notes(page) == {"loss-fusion", "loss-adversarial"} | PERSONAL
    # every image is an inline PNG, and nothing else is referenced: no script, stylesheet or link
    sources = re.findall(r'src="([^"]*)"', page)
    assert len(sources) == len(RUN_FIGURES) == page.count("<img")
    for source in sources:
        match = DATA_URI.fullmatch(source)
        assert match and base64.b64decode(match.group(1)).startswith(b"\x89PNG\r\n\x1a\n")
    outside = DATA_URI.sub("", page).lower()
    assert "http" not in outside and "<script" not in outside and "<link" not in outside
    assert "href=" not in outside and "url(" not in outside
    # the header: dataset, clients, alpha, seed, accuracy, wall time, and the config as collapsible JSON
    results = json.loads((run / "results.json").read_text())
    for row in ("dataset", "clients", "alpha", "seed", "global accuracy", "wall time (s)"):
        assert f"<td>{row}</td>" in page
    assert f'<td class="num">{results["global_accuracy"]:.4f}</td>' in page
    config = re.search(r"<details><summary>config.*?<pre>(.*?)</pre></details>", page, re.S)
    assert config and json.loads(html.unescape(config.group(1))) == results["config"]


def test_the_page_shows_what_the_teachers_knew_and_what_the_server_kept(run):
    results = json.loads((run / "results.json").read_text())
    teachers = results["teachers"]
    # the ceilings of the classifier uploads on the test split, the global model beside them
    assert 0 <= teachers["mean"] <= 1 and 0 <= teachers["label_weighted"] <= teachers["oracle"] <= 1
    assert teachers["global"] == results["global_accuracy"]
    assert teachers["retention"] == round(teachers["global"] / teachers["label_weighted"], 4)
    assert len(teachers["per_class"]["label_weighted"]) == len(teachers["global_per_class"]) == 10
    page = (run / REPORT_FILE).read_text()
    assert "<td>retention (global / label-weighted vote)</td>" in page
    assert f'<td class="num">{teachers["retention"]:.4f}</td>' in page
    table = re.search(r"Where the points go.*?</table>", page, re.S)
    assert table and table.group(0).count("<tr>") == 1 + 10  # the header, then a row per class


def test_report_command_rebuilds_the_same_page(run, tmp_path, capsys):
    copy = copy_run(run, tmp_path / "run")
    assert not (copy / REPORT_FILE).exists()
    assert main(["report", str(copy)]) == 0
    assert capsys.readouterr().out.strip() == str(copy / REPORT_FILE)
    assert (copy / REPORT_FILE).read_bytes() == (run / REPORT_FILE).read_bytes()  # same files, same page


def test_every_figure_is_drawn_when_the_run_has_its_data(run, tmp_path):
    copy = copy_run(run, tmp_path / "run")

    def add_curves(report):
        report["fusion_loss"] = [2.0, 1.5, 1.2]
        report["adversarial"] = {"student_loss": [0.9, 0.7], "adv": [0.3, 0.2], "kept": [0.8, 0.9]}

    edit_json(copy / "server" / "report.json", add_curves)
    for method, after in (("pkt", 0.93), ("finetune", 0.9)):
        personal = copy / "personal" / "client_00" / method
        personal.mkdir(parents=True)
        report = {
            "val_accuracy_before": {"own_model": 0.8, "global_model": 0.7},
            "val_accuracy": {"fp32": after, "int8": after - 0.01},
            "kept": "fp32",
            "curves": {"personalize": {"epoch": [1, 2, 3], "ce": [1.2, 0.8, 0.6], "pkt": [0.3, 0.2, 0.2]}},
        }
        (personal / "report.json").write_text(json.dumps(report))
    page = write_report(copy).read_text()
    assert figures(page) == EVERY_FIGURE
    assert notes(page) == set()


def test_absent_or_malformed_data_gives_a_note_never_an_empty_figure(run, tmp_path):
    copy = tmp_path / "run"
    copy.mkdir()
    shutil.copy(run / "results.json", copy / "results.json")
    page = write_report(copy).read_text()
    assert figures(page) == {"clients", "phases"}  # results.json alone holds these two
    assert notes(page) == EVERY_FIGURE - {"clients", "phases"}

    (copy / "data").mkdir()
    partition = json.loads((run / "data" / "partition.json").read_text())
    partition["label_histogram"][0][0] = "many"  # not a count: noted, not drawn
    (copy / "data" / "partition.json").write_text(json.dumps(partition))
    (copy / "server").mkdir()
    (copy / "server" / "pseudo_images.png").write_bytes(b"not a png")
    # a grid of the right layout (10 rows + padding) but 4.4 million pixels is refused from its header
    buf = io.BytesIO()
    Image.new("RGB", (2102, 2102)).save(buf, format="PNG")
    (copy / "server" / "decoder_samples.png").write_bytes(buf.getvalue())

    def break_seconds(results):
        results["seconds"] = {"clients": "slow"}
        results["clients"] = [{"client": 0, "test_accuracy": None}]

    edit_json(copy / "results.json", break_seconds)
    page = write_report(copy).read_text()
    assert figures(page) == set()
    assert {"partition", "grid-pseudo-images", "grid-decoder-samples", "phases", "clients"} <= notes(page)

    partition["label_histogram"] = [[1] * 10] * 201  # more clients than a figure can show
    (copy / "data" / "partition.json").write_text(json.dumps(partition))
    assert "partition" in notes(write_report(copy).read_text())


def test_strings_from_the_run_are_escaped(run, tmp_path):
    copy = copy_run(run, tmp_path / "run")
    hostile = '<script>alert("x")</script>'

    def poison(results):
        results["config"]["dataset"] = "</title>" + hostile
        results["clients"][0]["arch"] = hostile
        results["clients"][1]["profile"] = '"><img src=x onerror=alert(1)>'
        results["seconds"] = {"$\\frac{a}{b}$" + hostile: 1.0, "total": 2.0}  # mathtext off: drawn as text
        results["phase_order"] = list(results["seconds"])

    edit_json(copy / "results.json", poison)
    edit_json(
        copy / "server" / "report.json", lambda r: r.update(training=hostile, synthetic_sources={hostile: 1})
    )
    page = write_report(copy).read_text()
    outside = DATA_URI.sub("", page)
    assert "<script" not in outside.lower()
    assert "<img src=x" not in outside
    assert "</title><script" not in outside
    assert html.escape(hostile) in outside and "&lt;/title&gt;" in outside
    assert "phases" in figures(page)


def test_a_run_without_results_is_refused_with_the_fix(tmp_path):
    with pytest.raises(DataError, match=r"results\.json.*fix: pass the output directory"):
        write_report(tmp_path)
    (tmp_path / "results.json").write_text("{torn")
    with pytest.raises(DataError, match="expected JSON"):
        write_report(tmp_path)
    (tmp_path / "results.json").write_text("[1, 2]")
    with pytest.raises(DataError, match="expected a JSON object"):
        write_report(tmp_path)
    assert not (tmp_path / REPORT_FILE).exists()


PROBE = """<script>
window.addEventListener("load", () => {
  const probe = document.createElement("pre");
  probe.id = "probe";
  const images = [...document.images];
  probe.textContent = JSON.stringify(images.map(i => [i.complete, i.naturalWidth, i.naturalHeight]));
  document.body.appendChild(probe);
});
</script>"""


def test_every_image_loads_in_headless_chromium(run, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium not installed: apt-get install chromium")
    page = (run / REPORT_FILE).read_text()
    # a copy with a probe that lists every image's natural size once the page has loaded (the report
    # itself carries no script)
    probe_page = tmp_path / "probe.html"
    probe_page.write_text(page.replace("</body>", PROBE + "</body>"))
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000"]
    dom = subprocess.run(
        [*flags, "--dump-dom", probe_page.as_uri()], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    found = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert found, f"the probe did not run; chromium printed: {dom[:500]}"
    sizes = json.loads(html.unescape(found.group(1)))
    assert len(sizes) == page.count("<img") == len(RUN_FIGURES)
    assert all(complete and width > 0 and height > 0 for complete, width, height in sizes), sizes

    shot = tmp_path / "report.png"
    subprocess.run(
        [
            *flags,
            "--hide-scrollbars",
            "--window-size=1200,3000",
            f"--screenshot={shot}",
            (run / REPORT_FILE).as_uri(),
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert shot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and shot.stat().st_size > 10_000


def test_each_device_phase_has_a_figure_with_a_line_per_client(run):
    """The curves of the clients' reports, one figure per device phase, each client's curve as written."""
    for k in (0, 1):
        report = json.loads((run / "clients" / f"client_{k:02d}.bundle.report.json").read_text())
        curves = report["curves"]
        assert set(curves) == {"search", "classifier", "cvae"}  # both roles: laptop and pi train both
        assert curves["classifier"]["epoch"] == [1, 2, 3] and curves["cvae"]["epoch"] == [1, 2]
        assert set(curves["cvae"]) == {"epoch", "loss", "recon", "kl"}
    drawn, skipped = device_curves(read_run(run), "cvae")
    assert [name for name, _ in drawn] == ["client 0 (both)", "client 1 (both)"] and skipped == []


def test_a_malformed_curve_is_skipped_with_a_note_never_a_crash(run, tmp_path):
    copy = copy_run(run, tmp_path / "run")

    def break_client_0(report):
        report["curves"]["classifier"]["train_loss"] = [1.0]  # 3 epochs, 1 value
        report["curves"]["cvae"] = "low"
        report["curves"]["search"] = {"epoch": [], "train_loss": []}

    def break_client_1(report):
        report["curves"]["search"] = {"epoch": [1], "train_loss": ["<b>x</b>"]}

    edit_json(copy / "clients" / "client_00.bundle.report.json", break_client_0)
    edit_json(copy / "clients" / "client_01.bundle.report.json", break_client_1)
    page = write_report(copy).read_text()
    # client 1's classifier and CVAE curves are still drawn; no search curve is left to draw
    assert figures(page) == RUN_FIGURES - {"loss-search"}
    assert notes(page) == {"loss-fusion", "loss-adversarial", "loss-search"} | PERSONAL | {
        "skipped-search",
        "skipped-classifier",
        "skipped-cvae",
    }
    skipped = re.search(r'id="note-skipped-classifier">(.*?)</p>', page).group(1)
    assert "skipped 1 malformed classifier curve(s): client 0 (both): curves.classifier.train_loss" in skipped
    assert "must be a list of 3 values" in skipped and "fix:" in skipped
    assert "skipped 2 malformed search curve(s)" in page and "&lt;b&gt;x&lt;/b&gt;" in page  # escaped

    # a report of an SDK before the curves: nothing to draw, nothing malformed; curves not a dict: malformed
    edit_json(copy / "clients" / "client_00.bundle.report.json", lambda r: r.pop("curves"))
    edit_json(copy / "clients" / "client_01.bundle.report.json", lambda r: r.update(curves=[1, 2]))
    page = write_report(copy).read_text()
    assert not figures(page) & {"loss-search", "loss-classifier", "loss-cvae"}
    assert "client 1 (both): curves must be a dict of phases, got list" in page


def test_a_client_report_too_large_is_refused_before_it_is_read(run, tmp_path):
    copy = copy_run(run, tmp_path / "run")
    path = copy / "clients" / "client_00.bundle.report.json"
    path.write_text(json.dumps({"pad": "x" * MAX_DEVICE_REPORT_BYTES}))
    with pytest.raises(DataError, match=r"must be at most 4194304 bytes, got 41943\d\d"):
        write_report(copy)


@pytest.mark.parametrize("clients", [5, 100])
def test_a_curve_figure_names_a_few_clients_and_summarises_many(clients):
    lines = [(f"client {k} (both)", [1.0, 2.0, 3.0], [2.0 + k, 1.0 + k, 0.5 + k]) for k in range(clients)]
    fig = clients_curve_figure({"recon": lines, "KL": lines})
    assert [ax.get_ylabel() for ax in fig.axes] == ["recon", "KL"]
    legend = [t.get_text() for t in fig.axes[-1].get_legend().get_texts()]
    if clients <= MAX_NAMED_LINES:
        assert legend == [name for name, _, _ in lines] and len(fig.axes[0].lines) == clients
    else:  # the median of every epoch, and the bands of the middle half and the range
        assert legend == ["range", "middle half", "median of 100 clients"]
        assert list(fig.axes[0].lines[0].get_ydata()) == [51.5, 50.5, 50.0]
    assert clients_curve_figure({"recon": []}) is None
    assert clients_curve_figure({"recon": [lines[0]] * 201}) is None  # more than MAX_DRAWN_CLIENTS (200)
