"""A real ``lightning`` run whose checkpoint is a sharded folder (DCP plus ``meta.pt``).

    python tests/layouts/lightning_sharded_run.py OUT_FOLDER

Two CPU processes train a small MLP for 3 Adam steps with Lightning's
``ModelParallelStrategy`` (FSDP2's ``fully_shard`` applied in
``configure_model``), then ``Trainer.save_checkpoint`` writes
``OUT_FOLDER/last.ckpt/``: ``.metadata``, one ``__R_0.distcp`` per rank and
``meta.pt``. Lightning starts the second process by running this script
again, so it runs as a script, not inside pytest.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, TensorDataset


class MLP(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(),
                                        torch.nn.Linear(10, 10), torch.nn.Tanh(),
                                        torch.nn.Linear(10, 3))

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.body:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.body, mesh=mesh)

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.body(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2, betas=(0.8, 0.95))


def main(out: Path) -> None:
    torch.manual_seed(2)
    torch.set_num_threads(1)
    data = TensorDataset(torch.randn(24, 6), torch.randn(24, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(
            max_steps=3, accelerator="cpu", devices=2, logger=False,
            strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=out,
        )  # fmt: skip
        trainer.fit(MLP(), DataLoader(data, batch_size=4))
        trainer.save_checkpoint(out / "last.ckpt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
