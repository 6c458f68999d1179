"""The HAPFNAS flow through the CLIs: supernet on the server, evolution on devices, heteroFedAvg."""

from __future__ import annotations

import json

import torch

from edge_sdk.cli import main as edge_main
from edge_sdk.data import ArrayDataset, save_client_data
from export.bundle import read_bundle
from export.onnx_export import read_metadata
from server_kit.aggregate import aggregate
from server_kit.cli import main as server_main
from tests.server_kit.test_aggregate import SHAPE, L, bundles, tiny_config  # noqa: F401
from tests.server_kit.test_synth_sources import TINY_GENERATOR


def test_supernet_evolution_and_hetero_avg(tmp_path, bundles, capsys):  # noqa: F811
    aggregate(
        bundles, tmp_path / "server", config=tiny_config(synth=("generator",), generator=TINY_GENERATOR)
    )
    supernet = tmp_path / "supernet.file"
    assert server_main(["supernet", *bundles, "--aggregate", str(tmp_path / "server"), "--out", str(supernet),
                        "--steps", "3", "--batch-size", "8", "--quiet", "--format", "json"]) == 0  # fmt: skip
    printed = json.loads(capsys.readouterr().out)  # --format json: the result as one object (#20)
    assert printed["wrote"] == str(supernet) and printed["data"] == "synthetic" and printed["steps"] == 3
    assert json.loads((tmp_path / "supernet.file.json").read_text())["data"] == "synthetic"
    clients = []
    for k in range(2):
        gen = torch.Generator().manual_seed(k)
        data = ArrayDataset(
            torch.randint(0, 256, (60, *SHAPE), generator=gen, dtype=torch.uint8), torch.arange(60) % L, L
        )
        npz = save_client_data(tmp_path / f"c{k}.npz", data)
        out = tmp_path / f"c{k}.bundle"
        args = ["run", "--data", str(npz), "--profile", "laptop-cpu", "--out", str(out), "--seed", str(k),
                "--strategy", "evolution", "--supernet", str(supernet), "--population", "4",
                "--mutations", "2", "--crossovers", "2", "--generations", "1", "--final-epochs", "1",
                "--quiet"]  # fmt: skip
        assert edge_main(args) == 0
        assert read_bundle(out).arch.startswith("mbv3:")
        clients.append(str(out))
    capsys.readouterr()
    argv = ["hetero-avg", *clients, "--supernet", str(supernet), "--out", str(tmp_path / "hfa")]
    assert server_main([*argv, "--format", "json"]) == 0
    report = json.loads((tmp_path / "hfa" / "hetero_avg.json").read_text())
    printed = json.loads(capsys.readouterr().out)
    assert printed == {"clients": report["clients"], "wrote": str(tmp_path / "hfa")}
    for row, path in zip(report["clients"], clients, strict=True):
        model = (tmp_path / "hfa" / row["onnx"]).read_bytes()
        assert read_metadata(model)["arch"] == read_bundle(path).arch
    assert (tmp_path / "hfa" / "supernet.safetensors.msgpack").is_file()
