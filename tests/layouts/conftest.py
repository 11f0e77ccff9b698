"""Real checkpoints, built by the libraries that write them, once per test session.

Each fixture runs the real writer (transformers ``save_pretrained`` and a
``Trainer`` run, huggingface_hub ``save_torch_state_dict``, a ``lightning``
run) on a tiny GPT-2 or MLP on the CPU; nothing imitates their files.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from tests.cli.conftest import gradclip  # noqa: F401 (the in-process runner)

VOCAB, WIDTH, LAYERS, CONTEXT = 48, 16, 2, 12


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_embd=WIDTH, n_layer=LAYERS, n_head=2,
                        n_positions=CONTEXT, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


@pytest.fixture(scope="session")
def sharded_pretrained(tmp_path_factory) -> Path:
    """``save_pretrained`` of a tiny GPT-2 in 6 KB shards (safetensors + index)."""
    folder = tmp_path_factory.mktemp("pretrained")
    tiny_gpt2().save_pretrained(folder, max_shard_size="6KB")
    return folder


@pytest.fixture(scope="session")
def sharded_bin(tmp_path_factory) -> Path:
    """``huggingface_hub.save_torch_state_dict(safe_serialization=False)``: torch shards and
    ``pytorch_model.bin.index.json`` (transformers 5 writes safetensors only)."""
    from huggingface_hub import save_torch_state_dict

    folder = tmp_path_factory.mktemp("pretrained_bin")
    state = {k: v for k, v in tiny_gpt2().state_dict().items() if k != "lm_head.weight"}
    save_torch_state_dict(state, folder, max_shard_size="6KB", safe_serialization=False)
    assert (folder / "pytorch_model.bin.index.json").exists()
    return folder


@pytest.fixture(scope="session")
def trainer_run(tmp_path_factory) -> Path:
    """A real ``transformers.Trainer`` run: 4 AdamW steps on the CPU, a checkpoint at step 4."""
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    class Tokens(Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(1)
            self.ids = torch.randint(0, VOCAB, (16, CONTEXT), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    out = tmp_path_factory.mktemp("trainer")
    args = TrainingArguments(
        output_dir=os.fspath(out), max_steps=4, save_steps=4, per_device_train_batch_size=4,
        learning_rate=1e-3, lr_scheduler_type="constant", weight_decay=0.1, use_cpu=True,
        report_to=[], logging_steps=1,
        disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens()).train()
    return out / "checkpoint-4"


@pytest.fixture(scope="session")
def lightning_ckpt(tmp_path_factory) -> Path:
    """A real ``lightning`` run: 3 Adam steps of a small MLP, saved by the Trainer."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class MLP(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(),
                                            torch.nn.Linear(10, 10), torch.nn.Tanh(),
                                            torch.nn.Linear(10, 3))

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.body(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2, betas=(0.8, 0.95))

        def on_before_optimizer_step(self, optimizer):
            # The last step's gradients, kept for the checkpoint (as a monitor would).
            self.last_grads = {n: p.grad.detach().clone() for n, p in self.named_parameters()}

        def on_save_checkpoint(self, checkpoint):
            checkpoint["grads"] = self.last_grads

    torch.manual_seed(2)
    data = TensorDataset(torch.randn(24, 6), torch.randn(24, 3))
    out = tmp_path_factory.mktemp("lightning")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, default_root_dir=out)
        trainer.fit(MLP(), DataLoader(data, batch_size=8))
        trainer.save_checkpoint(out / "last.ckpt")
    return out / "last.ckpt"


@pytest.fixture(scope="session")
def lightning_sharded(tmp_path_factory) -> Path:
    """A real ``lightning`` run with ``ModelParallelStrategy`` (FSDP2) on two CPU processes:
    its sharded ``last.ckpt/`` folder (``lightning_sharded_run.py``)."""
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("lightning_sharded")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    run = subprocess.run([sys.executable, os.fspath(Path(__file__).with_name(
        "lightning_sharded_run.py")), os.fspath(out)], env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=3600, cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-4000:]
    return out / "last.ckpt"


def _spawn_two_ranks(save_rank, tmp_path_factory, name: str) -> Path:
    """Run ``save_rank(rank, 2, outdir)`` on two spawned gloo ranks; the folder it wrote.

    Each rank closes its group with the other and leaves without the interpreter's
    teardown (``tests.gloo``), where a gloo rank used to abort after writing its files.
    A rank killed by a signal all the same is run again once in a fresh folder; an
    exception the script raises, or a second abort, fails the fixture.
    """
    from torch.multiprocessing.spawn import ProcessExitedException

    from tests import gloo

    outdir = tmp_path_factory.mktemp(name)
    try:
        gloo.spawn(save_rank, 2, str(outdir), nprocs=2)
        return outdir
    except ProcessExitedException as exited:
        if exited.signal_name is None:
            raise
        warnings.warn(f"{name} fixture: {exited}; run again", stacklevel=2)
    outdir = tmp_path_factory.mktemp(name)
    gloo.spawn(save_rank, 2, str(outdir), nprocs=2)
    return outdir


@pytest.fixture(scope="session")
def dcp_checkpoint(tmp_path_factory) -> Path:
    """A real FSDP2 DCP folder: ``dcp.save`` on two spawned gloo ranks (``dcp_ranks.py``)."""
    from .dcp_ranks import save_rank

    outdir = _spawn_two_ranks(save_rank, tmp_path_factory, "dcp")
    return outdir / "checkpoint"


@pytest.fixture(scope="session")
def dcp_hf_checkpoint(tmp_path_factory) -> Path:
    """DCP's Hugging Face layout from two spawned FSDP2 ranks (``dcp_hf_ranks.py``), with
    ``reference.pt`` (every parameter whole) beside the folder."""
    from .dcp_hf_ranks import save_rank

    outdir = _spawn_two_ranks(save_rank, tmp_path_factory, "dcp_hf")
    return outdir / "checkpoint"


def _deepspeed_run(module: str, out: Path, *args: str, timeout: int = 3600) -> None:
    """``python -m tests.layouts.<module> OUT ARGS``: a real DeepSpeed CPU run (gloo, two
    processes it spawns itself), away from any launcher's variables."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", f"tests.layouts.{module}", os.fspath(out),
                          *args], env=env, capture_output=True, text=True, timeout=timeout,
                         cwd=Path(__file__).resolve().parents[2])
    assert run.returncode == 0, run.stderr[-4000:]


@pytest.fixture(scope="session")
def deepspeed_runs(tmp_path_factory) -> Path:
    """Real DeepSpeed ZeRO 1, 2 and 3 checkpoints (``deepspeed_runs.py``): ``zeroN/`` each,
    with ``zeroN.reference.pt`` beside. One 2-process CPU run builds all three."""
    out = tmp_path_factory.mktemp("deepspeed")
    _deepspeed_run("deepspeed_runs", out)
    return out


@pytest.fixture(scope="session")
def deepspeed_tp_runs(tmp_path_factory) -> Path:
    """Real DeepSpeed checkpoints of two tensor-parallel ranks (``deepspeed_tp_run.py``):
    ``zero1_core/``, ``zero2_legacy/``, ``zero1_plain/``, ``zero3_core/``, ``zero0_core/``,
    each with ``<run>.step<N>.reference.pt`` beside (``zero2_dp2/`` on 4 processes)."""
    out = tmp_path_factory.mktemp("deepspeed_tp")
    _deepspeed_run("deepspeed_tp_run", out)
    return out


@pytest.fixture(scope="session")
def deepspeed_pp_tp_runs(tmp_path_factory) -> Path:
    """Real DeepSpeed checkpoints of a ``PipelineModule`` of 2 stages x 2 tensor-parallel
    ranks on 4 processes (``deepspeed_tp_run.py --pipeline``): ``pipe2_zero0/`` (saved at
    steps 1 and 2) and ``pipe2_zero1/``, each with ``<run>.step<N>.reference.pt`` beside."""
    out = tmp_path_factory.mktemp("deepspeed_pp_tp")
    _deepspeed_run("deepspeed_tp_run", out, "--pipeline")
    return out


@pytest.fixture(scope="session")
def deepspeed_cpu_adam(tmp_path_factory) -> Path:
    """ZeRO 2 with the optimizer offloaded: DeepSpeed's own ``DeepSpeedCPUAdam``
    (``deepspeed_runs.py --cpu-adam``): ``zero2_cpu_adam/`` and its reference. Compiling
    the op takes minutes: slow tests only."""
    if not os.environ.get("GRADCLIP_SLOW"):
        pytest.skip("set GRADCLIP_SLOW=1 (DeepSpeedCPUAdam is compiled on first use)")
    out = tmp_path_factory.mktemp("deepspeed_cpu_adam")
    _deepspeed_run("deepspeed_runs", out, "--cpu-adam", timeout=7200)
    return out


@pytest.fixture(scope="session")
def deepspeed_trainer_run(tmp_path_factory) -> Path:
    """A real ``transformers.Trainer`` run under DeepSpeed ZeRO 2 on two CPU processes
    (``deepspeed_trainer_run.py``): ``checkpoint-1/`` .. ``checkpoint-3/`` and
    ``reference.pt`` in the returned ``output_dir``."""
    out = tmp_path_factory.mktemp("deepspeed_trainer")
    _deepspeed_run("deepspeed_trainer_run", out)
    return out


@pytest.fixture(scope="session")
def dcp_hf_grads(dcp_hf_checkpoint) -> Path:
    """The same run's gradients in DCP's Hugging Face layout (``dcp_hf_ranks.py``): FSDP2's
    shards, ``2.bias`` replicated (the same piece in both files), an int64 ``counts``;
    ``grads_reference.pt`` (every gradient whole) beside the folder."""
    return dcp_hf_checkpoint.parent / "grads"


@pytest.fixture(scope="session")
def accelerate_fsdp_run(tmp_path_factory) -> Path:
    """accelerate's FSDP checkpoints from two spawned FSDP2 ranks
    (``accelerate_fsdp_ranks.py``): ``run/checkpoint-1/`` and ``run/checkpoint-2/``."""
    from .accelerate_fsdp_ranks import save_rank

    outdir = _spawn_two_ranks(save_rank, tmp_path_factory, "accelerate_fsdp")
    return outdir / "run"


@pytest.fixture(scope="session")
def accelerate_state(tmp_path_factory) -> Path:
    """``Accelerator(cpu=True).save_state`` after 3 AdamW steps of a small CNN."""
    from accelerate import Accelerator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3),
                                torch.nn.Flatten(), torch.nn.Linear(48, 2))
    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(3):
        x = torch.randn(4, 2, 6, 6, generator=torch.Generator().manual_seed(step))
        accelerator.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
    out = tmp_path_factory.mktemp("accelerate") / "state"
    accelerator.save_state(os.fspath(out))
    # The same state through torch.save (pytorch_model.bin keeps the model's order).
    accelerator.save_state(os.fspath(out.parent / "state_bin"), safe_serialization=False)
    return out


@pytest.fixture(scope="session")
def accelerate_auto_runs(tmp_path_factory) -> Path:
    """``save_state()`` twice under ``ProjectConfiguration(automatic_checkpoint_naming=True)``
    (``checkpoints/checkpoint_0``, ``checkpoint_1``), the optimizer given named parameters."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3),
                                torch.nn.Flatten(), torch.nn.Linear(48, 2))
    project = tmp_path_factory.mktemp("accelerate_auto")
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=os.fspath(project), automatic_checkpoint_naming=True))
    model, opt = accelerator.prepare(
        model, torch.optim.AdamW(model.named_parameters(), lr=1e-2))
    for step in range(4):
        x = torch.randn(4, 2, 6, 6, generator=torch.Generator().manual_seed(step))
        accelerator.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
        if step % 2:
            accelerator.save_state()
    return project / "checkpoints"


@pytest.fixture(scope="session")
def verl_fsdp2_files(tmp_path_factory) -> Path:
    """verl's FSDP file layout written by torch's FSDP2 on two spawned gloo ranks
    (``verl_fsdp2_ranks.py``): ``global_step_2/actor/``, ``reference.pt``, ``partial/``
    and ``mesh2d/``."""
    from .verl_fsdp2_ranks import save_rank

    return _spawn_two_ranks(save_rank, tmp_path_factory, "verl_fsdp2")
