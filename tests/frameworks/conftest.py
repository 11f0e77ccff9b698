"""Checkpoints written by the pretraining frameworks themselves, once per test session.

torchtitan, OLMo-core, Megatron-core, torchtune, litgpt and timm are heavy (and
pin their own dependencies), so they live in a venv of their own, never in the
one the tests run in: ``GRADCLIP_FRAMEWORKS_PYTHON`` names its interpreter (``.ci/run``
builds it). Each fixture runs one generator script of this folder in that
interpreter, in a subprocess (under ``torchrun`` for its ranks, or alone); the
script trains a tiny model for a few steps, saves with the framework's own
checkpointing code, and writes beside the checkpoint what the framework's
(or torch's) own loader reads back: the tests' reference. Without the
variable every test here is skipped, saying so.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.cli.conftest import gradclip  # noqa: F401 (the in-process runner)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VARIABLE = "GRADCLIP_FRAMEWORKS_PYTHON"


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).resolve().parent == HERE:
            item.add_marker(pytest.mark.frameworks)


@pytest.fixture(scope="session")
def framework_python() -> str:
    python = os.environ.get(VARIABLE)
    if not python:
        pytest.skip(
            f"{VARIABLE} is not set: it names the python of a venv with torchtitan, "
            "ai2-olmo-core, megatron-core, torchtune, litgpt and timm (.ci/run builds one)"
        )
    if not os.access(python, os.X_OK):
        pytest.skip(f"{VARIABLE}={python} is not an executable")
    return python


def run_generator(python: str, script: str, out: Path, ranks: int, *extra: str) -> Path:
    """Run ``tests/frameworks/SCRIPT OUT`` under ``torchrun`` with ``ranks`` gloo ranks
    (``ranks=0``: in one plain process, for a framework that trains without a process
    group)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    launch = (
        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        if ranks
        else []
    )
    command = [python, *launch, str(HERE / script), str(out), *extra]
    for _attempt in range(2):  # a gloo rank may abort at exit once in a while (seen in CI)
        done = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=420
        )
        if done.returncode == 0:
            return out
    raise AssertionError(
        f"{script} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    )


@pytest.fixture(scope="session")
def torchtitan_runs(framework_python, tmp_path_factory) -> dict[int, Path]:
    """torchtitan runs on 1 and 2 ranks: ``run/checkpoint/step-{1,2,3}`` and ``reference/``."""
    return {
        ranks: run_generator(
            framework_python,
            "torchtitan_run.py",
            tmp_path_factory.mktemp(f"torchtitan{ranks}"),
            ranks,
        )
        for ranks in (1, 2)
    }


@pytest.fixture(scope="session")
def olmo_core_runs(framework_python, tmp_path_factory) -> dict[int, Path]:
    """OLMo-core runs on 1 rank and on 2 (FSDP): ``run/step{1,2,3}`` and ``reference/``."""
    return {
        ranks: run_generator(
            framework_python,
            "olmo_core_run.py",
            tmp_path_factory.mktemp(f"olmo_core{ranks}"),
            ranks,
        )
        for ranks in (1, 2)
    }


# The OLMo-core spike runs (``olmo_core_spike_run.py``): seed -> the injected layer and
# factor, or None for a clean run (the keys of ``olmo_core_spike_runs``).
OLMO_CORE_SPIKES = {
    ("injected", 0): ("blocks.0", 20.0),
    ("injected", 1): ("blocks.1", 50.0),
    ("injected", 2): ("embeddings", 100.0),
    ("clean", 0): None,
    ("clean", 1): None,
}


@pytest.fixture(scope="session")
def olmo_core_spike_runs(framework_python, tmp_path_factory) -> dict[tuple[str, int], Path]:
    """OLMo-core runs of 50 steps on 1 rank, a spike injected at step 35 into one layer (or
    none): ``run/step*`` (OLMo-core's ``Checkpointer``), ``run/grads.jsonl`` and
    ``run/spikes/`` (gradclip's ``GradMonitor``), ``reference/spike.pt``."""
    runs = {}
    for (kind, seed), inject in OLMO_CORE_SPIKES.items():
        extra = (inject[0], f"{inject[1]:g}") if inject else ()
        out = tmp_path_factory.mktemp(f"olmo_core_spike_{kind}{seed}")
        runs[kind, seed] = run_generator(
            framework_python, "olmo_core_spike_run.py", out, 1, str(seed), *extra
        )
    return runs


@pytest.fixture(scope="session")
def megatron_runs(framework_python, tmp_path_factory) -> dict:
    """Megatron-core runs on 1 rank, on 2 data-parallel ranks, on 2 tensor-parallel ranks
    (``"tp2"``) and on 2 pipeline stages of 2 tensor-parallel ranks each (``"tp2pp2"``, 4
    ranks): ``run/iter_000000{1,2,3}``, ``run/latest_checkpointed_iteration.txt`` and
    ``reference/``."""
    runs: dict = {
        ranks: run_generator(
            framework_python, "megatron_run.py", tmp_path_factory.mktemp(f"megatron{ranks}"), ranks
        )
        for ranks in (1, 2)
    }
    runs["tp2"] = run_generator(
        framework_python, "megatron_run.py", tmp_path_factory.mktemp("megatron_tp2"), 2, "tp"
    )
    runs["tp2pp2"] = run_generator(
        framework_python,
        "megatron_run.py",
        tmp_path_factory.mktemp("megatron_tp2pp2"),
        4,
        "tp=2",
        "pp=2",
    )
    return runs


@pytest.fixture(scope="session")
def megatron_distopt_run(framework_python, tmp_path_factory) -> Path:
    """Megatron-core's DDP and distributed optimizer on 2 data-parallel ranks, saved as
    ``torch_dist`` the way Megatron-LM's ``save_checkpoint`` does by default (the optimizer's
    state as ``dp_reshardable`` grad-buffer buckets): ``run/iter_000000{1,2,3}`` and
    ``reference/`` (the weights Megatron loads, and the moments its optimizer holds once it
    has loaded the buckets)."""
    out = tmp_path_factory.mktemp("megatron_distopt")
    return run_generator(framework_python, "megatron_run.py", out, 2, "distopt")


@pytest.fixture(scope="session")
def megatron_distopt_tp_run(framework_python, tmp_path_factory) -> Path:
    """As ``megatron_distopt_run``, the 2 ranks tensor parallel: each rank's buckets are
    ``dp_group_idx_<its tensor-parallel rank>`` and hold its shards (and whole copies of the
    replicated tensors); ``reference/iter_N.rankR.pt`` per rank."""
    out = tmp_path_factory.mktemp("megatron_distopt_tp")
    return run_generator(framework_python, "megatron_run.py", out, 2, "distopt", "tp")


@pytest.fixture(scope="session")
def megatron_distopt_pp_run(framework_python, tmp_path_factory) -> Path:
    """As ``megatron_distopt_run``, the 2 ranks 2 pipeline stages (a layer each, the
    embeddings on the first, the final norm and output layer on the second): each rank's
    buckets are ``dp_group_idx_<its stage>``; ``reference/iter_N.rankR.pt`` per rank."""
    out = tmp_path_factory.mktemp("megatron_distopt_pp")
    return run_generator(framework_python, "megatron_run.py", out, 2, "distopt", "pp")


@pytest.fixture(scope="session")
def megatron_distopt_tp_pp_run(framework_python, tmp_path_factory) -> Path:
    """The distributed optimizer on 2 pipeline stages of 2 tensor-parallel ranks each (4
    ranks): each model-parallel rank's buckets (``dp_group_idx_0`` .. ``_3``) its own."""
    out = tmp_path_factory.mktemp("megatron_distopt_tp_pp")
    return run_generator(framework_python, "megatron_run.py", out, 4, "distopt", "tp=2", "pp=2")


@pytest.fixture(scope="session")
def megatron_distopt_odd_run(framework_python, tmp_path_factory) -> Path:
    """As ``megatron_distopt_run``, with buckets of 1100 elements: the first bucket closes
    on a layer norm's 16 elements, so the next bucket's start is no multiple of 64 in the
    buckets laid side by side."""
    out = tmp_path_factory.mktemp("megatron_distopt_odd")
    return run_generator(framework_python, "megatron_run.py", out, 2, "distopt", "bucket=1100")


@pytest.fixture(scope="session")
def megatron_bf16_run(framework_python, tmp_path_factory) -> Path:
    """A Megatron-core run in bf16 mixed precision, as Megatron-LM's ``--bf16`` sets it up
    (``Float16Module``, Megatron's DDP, ``get_megatron_optimizer``'s
    ``Float16OptimizerWithFloat16Params``), on 1 rank: bf16 model tensors, fp32 main params
    (``optimizer.state.fp32_param.*``) beside the moments; ``reference/``."""
    out = tmp_path_factory.mktemp("megatron_bf16")
    return run_generator(framework_python, "megatron_run.py", out, 1, "bf16")


@pytest.fixture(scope="session")
def megatron_tp_bf16_run(framework_python, tmp_path_factory) -> Path:
    """As ``megatron_bf16_run``, on 2 tensor-parallel ranks: ``reference/iter_N.rankR.pt``."""
    out = tmp_path_factory.mktemp("megatron_tp_bf16")
    return run_generator(framework_python, "megatron_run.py", out, 2, "tp", "bf16")


@pytest.fixture(scope="session")
def megatron_pp_bf16_run(framework_python, tmp_path_factory) -> Path:
    """2 pipeline stages in bf16 mixed precision, the plain optimizer: each stage's fp32 main
    params its own ``optimizer.state.fp32_param`` chunks."""
    out = tmp_path_factory.mktemp("megatron_pp_bf16")
    return run_generator(framework_python, "megatron_run.py", out, 2, "pp", "bf16")


@pytest.fixture(scope="session")
def megatron_distopt_bf16_run(framework_python, tmp_path_factory) -> Path:
    """As ``megatron_distopt_run`` (2 data-parallel ranks), in bf16 mixed precision: the
    buckets' ``param`` are the fp32 main params of bf16 model tensors."""
    out = tmp_path_factory.mktemp("megatron_distopt_bf16")
    return run_generator(framework_python, "megatron_run.py", out, 2, "distopt", "bf16")


@pytest.fixture(scope="session")
def megatron_distopt_fully_bf16_run(framework_python, tmp_path_factory) -> Path:
    """As ``megatron_distopt_bf16_run``, saved as Megatron-LM's
    ``--dist-ckpt-optim-fully-reshardable`` saves it: each parameter's main param and
    moments as ``optimizer.state.{param,exp_avg,exp_avg_sq}.<name>``, the step in
    ``common.pt``'s param groups."""
    out = tmp_path_factory.mktemp("megatron_distopt_fully_bf16")
    return run_generator(framework_python, "megatron_run.py", out, 2, "distopt", "bf16", "fully")


@pytest.fixture(scope="session")
def megatron_distopt_tp_bf16_run(framework_python, tmp_path_factory) -> Path:
    """As ``megatron_distopt_tp_run`` (2 tensor-parallel ranks), in bf16 mixed precision."""
    out = tmp_path_factory.mktemp("megatron_distopt_tp_bf16")
    return run_generator(framework_python, "megatron_run.py", out, 2, "distopt", "tp", "bf16")


@pytest.fixture(scope="session")
def megatron_distopt_tp_fully_bf16_run(framework_python, tmp_path_factory) -> Path:
    """As ``megatron_distopt_tp_bf16_run``, saved ``fully_reshardable``: each parameter's
    main param and moments in the model's sharding over the 2 tensor-parallel ranks."""
    out = tmp_path_factory.mktemp("megatron_distopt_tp_fully_bf16")
    return run_generator(framework_python, "megatron_run.py", out, 2, "distopt", "tp", "bf16",
                         "fully")


@pytest.fixture(scope="session")
def megatron_moe_runs(framework_python, tmp_path_factory) -> dict:
    """Megatron-core Mixture-of-Experts runs (4 experts a layer, a top-2 router): on 1 rank
    (``"ep1"``), on 2 expert-parallel ranks (``"ep2"``: 2 experts each, data parallel
    for the rest, Megatron's DDP and ``get_megatron_optimizer``'s ChainedOptimizer of the
    dense parameters' and the experts' optimizers; ``reference/iter_N.rankR.pt`` per
    rank), and on 1 rank with layer 0 a dense MLP (``"dense1"``: ``moe_layer_freq``,
    each layer saved under its number)."""
    return {
        "dense1": run_generator(
            framework_python,
            "megatron_run.py",
            tmp_path_factory.mktemp("megatron_moe_dense1"),
            1,
            "moe",
            "dense1",
        ),
        "ep1": run_generator(
            framework_python, "megatron_run.py", tmp_path_factory.mktemp("megatron_moe"), 1, "moe"
        ),
        "ep2": run_generator(
            framework_python,
            "megatron_run.py",
            tmp_path_factory.mktemp("megatron_moe_ep2"),
            2,
            "moe",
            "ep",
        ),
    }


@pytest.fixture(scope="session")
def megatron_moe_distopt_run(framework_python, tmp_path_factory) -> Path:
    """The Mixture-of-Experts model on 2 data-parallel ranks with Megatron's distributed
    optimizer (dp_reshardable): every expert in the one grad buffer's buckets; its routers
    with their expert bias, a buffer saved beside their weights (``bias``)."""
    out = tmp_path_factory.mktemp("megatron_moe_distopt")
    return run_generator(framework_python, "megatron_run.py", out, 2, "moe", "distopt", "bias")


@pytest.fixture(scope="session")
def megatron_moe_ep_distopt_run(framework_python, tmp_path_factory) -> Path:
    """The Mixture-of-Experts model on 2 expert-parallel ranks with Megatron's distributed
    optimizer: a ChainedOptimizer's two, their buckets under ``chained_0.`` (the dense
    parameters', over both ranks) and ``chained_1.`` (each rank's experts')."""
    out = tmp_path_factory.mktemp("megatron_moe_ep_distopt")
    return run_generator(framework_python, "megatron_run.py", out, 2, "moe", "ep", "distopt")


@pytest.fixture(scope="session")
def megatron_moe_ep_fully_run(framework_python, tmp_path_factory) -> Path:
    """As ``megatron_moe_ep_distopt_run``, saved ``fully_reshardable``: both chained
    optimizers' state per parameter (``optimizer.state.*``, no prefix), the steps in
    ``common.pt``'s ``optimizer.{0,1}.optimizer.param_groups``."""
    out = tmp_path_factory.mktemp("megatron_moe_ep_fully")
    return run_generator(
        framework_python, "megatron_run.py", out, 2, "moe", "ep", "distopt", "fully"
    )


@pytest.fixture(scope="session")
def megatron_lm_runs(framework_python, tmp_path_factory) -> dict:
    """Megatron-LM's own ``save_checkpoint`` in its legacy format (``megatron_lm_run.py``):
    1 rank in fp32 with the output layer tied to the embedding, Megatron's default
    (``"fp32"``), and 2 tensor-parallel ranks in bf16 with fp32 masters, untied
    (``"tp2"``): ``run/iter_000000{1,2,3}/mp_rank_XX/`` and ``reference/``. Needs a
    Megatron-LM checkout at tag core_v0.16.1 named by ``MEGATRON_LM_PATH`` (CI has none:
    skipped there); ``MEGATRON_LM_PYTHON`` may name a python other than the frameworks
    venv's (Megatron-LM's tokenizer module also imports ``regex``)."""
    checkout = os.environ.get("MEGATRON_LM_PATH")
    if not checkout or not os.path.isfile(Path(checkout) / "megatron/training/checkpointing.py"):
        pytest.skip("MEGATRON_LM_PATH does not name a Megatron-LM checkout (tag core_v0.16.1)")
    python = os.environ.get("MEGATRON_LM_PYTHON", framework_python)
    return {
        "python": python,
        "fp32": run_generator(
            python, "megatron_lm_run.py", tmp_path_factory.mktemp("megatron_lm"), 1, "tied"
        ),
        "tp2": run_generator(
            python,
            "megatron_lm_run.py",
            tmp_path_factory.mktemp("megatron_lm_tp2"),
            2,
            "tp",
            "bf16",
        ),
    }


@pytest.fixture(scope="session")
def torchtune_runs(framework_python, tmp_path_factory) -> Path:
    """torchtune's ``full_finetune_single_device`` recipe, 3 epochs of 2 AdamW steps:
    ``run/`` and ``in_bwd/`` (``optimizer_in_bwd``), each ``epoch_{0,1,2}/`` and
    ``recipe_state/recipe_state.pt``; ``hf/``, 2 epochs saved by
    ``FullModelHFCheckpointer``; ``lora/``, 2 epochs of ``lora_finetune_single_device``;
    ``lora_adapter/``, 2 epochs of it with ``save_adapter_weights_only`` (the adapter alone,
    no model shard, saved by ``FullModelHFCheckpointer``); ``reference/lora_names.json``."""
    out = tmp_path_factory.mktemp("torchtune")
    return run_generator(framework_python, "torchtune_run.py", out, 0)


@pytest.fixture(scope="session")
def timm_runs(framework_python, tmp_path_factory) -> Path:
    """timm's ``CheckpointSaver``, 2 epochs each: ``sgd/``, ``adamw/``, ``adamw_args/``
    (saved with ``args``, as timm's ``train.py`` does), and timm's own ``lamb/`` and
    ``lars/``, each ``checkpoint-{0,1}.pth.tar``."""
    out = tmp_path_factory.mktemp("timm")
    return run_generator(framework_python, "timm_run.py", out, 0)


@pytest.fixture(scope="session")
def litgpt_run(framework_python, tmp_path_factory) -> Path:
    """litgpt's pretraining ``save_checkpoint`` at each of 2 AdamW steps: the run's
    ``out/pretrain/``, holding ``step-0000000{1,2}/lit_model.pth``."""
    out = tmp_path_factory.mktemp("litgpt")
    return run_generator(framework_python, "litgpt_run.py", out, 0) / "out" / "pretrain"


def _litgpt_finetune(python: str, tmp_path_factory, method: str) -> Path:
    out = tmp_path_factory.mktemp(f"litgpt_{method}")
    return run_generator(python, "litgpt_finetune_run.py", out, 0, method) / "out"


@pytest.fixture(scope="session", params=["lora", "adapter", "adapter_v2"])
def litgpt_adapter_run(request, framework_python, tmp_path_factory) -> tuple[Path, str]:
    """``litgpt finetune_<method>``'s own output folder and the method, for each of litgpt's
    adapter fine-tunings, 2 steps each saved: ``step-00000{1,2}/`` (``lit_model.pth.<method>``,
    the adapter alone) and ``final/`` (the adapter; LoRA's also the base model with it merged
    in)."""
    method = request.param
    return _litgpt_finetune(framework_python, tmp_path_factory, method), method


@pytest.fixture(scope="session")
def litgpt_full_run(framework_python, tmp_path_factory) -> Path:
    """``litgpt finetune_full``'s own output folder, 2 steps each saved: ``step-00000{1,2}/``
    (``lit_model.pth``, the training state) and ``final/`` (``{"model": ...}``)."""
    return _litgpt_finetune(framework_python, tmp_path_factory, "full")


def _venv_python(variable: str, framework: str) -> str:
    """The python that ``variable`` names, a framework's own venv; the test is skipped,
    saying so, where it names none."""
    python = os.environ.get(variable)
    if not python or not os.access(python, os.X_OK):
        pytest.skip(f"{variable} does not name the python of a venv with {framework} "
                    "(.ci/run builds one)")
    return python


VERL_VARIABLE = "GRADCLIP_VERL_PYTHON"


@pytest.fixture(scope="session")
def verl_run(tmp_path_factory) -> Path:
    """verl's own ``FSDPCheckpointManager`` on 2 gloo ranks under FSDP2 (``verl_run.py``):
    ``run/global_step_{1,2}/actor/`` and ``reference/global_step_{1,2}.pt`` (what the same
    manager's ``load_checkpoint`` reads back). verl pins its own dependencies (ray,
    transformers...), so it has a venv of its own, named by ``GRADCLIP_VERL_PYTHON``
    (``.ci/run`` builds it); without it the tests are skipped, saying so."""
    python = _venv_python(VERL_VARIABLE, "verl 0.9.1")
    return run_generator(python, "verl_run.py", tmp_path_factory.mktemp("verl"), 2)


@pytest.fixture(scope="session")
def verl_tied_run(verl_run, tmp_path_factory) -> Path:
    """As ``verl_run``, the tiny Llama's output layer tied to its embedding: one parameter
    (one optimizer state) under two names in each rank's model file."""
    python = os.environ[VERL_VARIABLE]
    return run_generator(python, "verl_run.py", tmp_path_factory.mktemp("verl_tied"), 2, "tied")


NEMO_VARIABLE = "GRADCLIP_NEMO_PYTHON"


@pytest.fixture(scope="session")
def nemo_run(tmp_path_factory) -> Path:
    """NeMo 2's own trainer, strategy and ``ModelCheckpoint`` on the CPU (``nemo2_run.py``):
    ``run/step_{1,2,3}/`` (``weights/`` and ``context/``) and ``reference/step_N.pt`` (what
    NeMo's ``MegatronCheckpointIO`` reads back). NeMo pins its own stack (megatron-core
    0.15.3, lightning 2.4), so it has a venv of its own, named by ``GRADCLIP_NEMO_PYTHON``
    (``.ci/run`` builds it); without it the tests are skipped, saying so."""
    python = _venv_python(NEMO_VARIABLE, "nemo-toolkit 2.7.3")
    return run_generator(python, "nemo2_run.py", tmp_path_factory.mktemp("nemo"), 0)
