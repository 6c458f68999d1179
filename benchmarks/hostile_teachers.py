"""Hostile classifier bundles that are valid uploads but sabotage the server's phases (issue #34, class 2-3).

    .venv/bin/python benchmarks/hostile_teachers.py RUN --client 9 --mode slow --out RUN/hostile/slow.bundle

Both claim the label counts of ``RUN``'s client ``--client`` (honest-looking) and carry an architecture the
server cannot rebuild (``foreign-net``), so it converts their ONNX:

* ``slow``: 48 convolutions of one shared 64-channel weight: a small file, within the per-sample contract,
  dozens of times the cost of an honest teacher at the server's batch.
* ``nan``: the client's own classifier, plus a term that is 0 on inputs whose mean is above 0.3 (uniform
  noise, the load probe) and 0 / 0 on darker ones (a digit on its background): finite on noise, NaN on
  image-like inputs.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
from torch import nn

from export.bundle import read_bundle, write_bundle
from export.onnx_export import export_onnx
from server_kit.teachers.loading import load_teacher


class SharedConvs(nn.Module):
    def __init__(self, channels: int, num_classes: int, depth: int = 48, width: int = 64) -> None:
        super().__init__()
        self.stem = nn.Conv2d(channels, width, 3, padding=1)
        self.shared = nn.Conv2d(width, width, 3, padding=1)
        self.depth = depth
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for _ in range(self.depth):
            h = torch.relu(self.shared(h))
        return self.head(h.mean(dim=(2, 3)))


class NaNOnImages(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gap = torch.relu(x.mean(dim=(1, 2, 3), keepdim=True).flatten(1) - 0.3)  # 0 on a dark image
        return self.inner(x) + (gap / gap - 1.0)  # 0 where gap > 0, NaN (0 / 0) where it is 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", help="a simulate output directory (its clients/client_KK.bundle)")
    parser.add_argument("--client", type=int, required=True)
    parser.add_argument("--mode", choices=["slow", "nan"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    honest = read_bundle(Path(args.run) / "clients" / f"client_{args.client:02d}.bundle")
    shape = tuple(honest.input_shape)
    if args.mode == "slow":
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = SharedConvs(shape[0], honest.num_classes).eval()
    else:
        model = NaNOnImages(load_teacher(honest).module).eval()
    onnx = export_onnx(model, shape, metadata={"arch": "foreign-net"})
    write_bundle(
        dataclasses.replace(honest, model_onnx=onnx, arch="foreign-net", sdk_version="hostile"), args.out
    )
    print(f"wrote {args.out}: {args.mode}, {len(onnx)} bytes of ONNX, claims {list(honest.label_counts)}")


if __name__ == "__main__":
    main()
