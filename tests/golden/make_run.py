"""Records the golden run folder the report tests read: `python tests/golden/make_run.py`.

A tiny CNN, 2 repeats x 2 epochs x 2 steps, with a 1-ULP fault planted in the head's addmm
at step 1 of the last repeat, then the op drill-down and the census. Re-run it only when the
trace format changes; then refresh the expected renders with
``DETAUDIT_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from torch import nn

from detaudit import Fault, Probe, api
from detaudit.config import AuditConfig, Investigations

FOLDER = Path(__file__).parent / "planted"


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


def probe(device: torch.device) -> Probe:
    model = TinyNet().to(device)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(2, 3, 8, 8, generator=g), torch.randn(2, 2, generator=g))
               for _ in range(2)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(m: nn.Module, batch):
        x, y = batch
        return {"mse": (m(x) - y).pow(2).mean()}

    return Probe(model=model, batches=batches, step=step, optimizer=optimizer)


def main() -> None:
    torch.set_num_threads(1)
    shutil.rmtree(FOLDER, ignore_errors=True)
    config = AuditConfig(repeats=2, epochs=2, steps=2,
                         fault=Fault("head", "forward", 1, op="aten.addmm"))
    api.run(api.describe_callable(probe), config, factory=probe, out=FOLDER,
            investigations=Investigations(drill_down=True, census=True),
            command="detaudit run --probe tiny.py --epochs 2 --steps 2 "
            "--inject-fault head/aten.addmm:1")
    for name in ("summary.json", "report.md", "report.html", "report.github.html"):
        (FOLDER / name).unlink()  # the test renders these from the traces


if __name__ == "__main__":
    main()
