"""The simpler layouts' facts and their wording, apart: each sentence expected here is one a
real layout prints today (tests/layouts/test_evidence.py, test_small_files.py,
tests/cli, tests/frameworks), made from facts alone; no file is read."""

from __future__ import annotations

from pathlib import Path

from gradclip_cli.source.layouts.draft import Draft, Wording
from gradclip_cli.source.layouts.facts import (
    ENTRY,
    FILES,
    FLAT,
    KEY,
    MARK,
    PROOF,
    STATE,
    UNMARKED,
    Found,
    NoGradients,
    NotGradients,
    evidence,
    wording,
)
from gradclip_cli.source.roles import GRADIENT, OPTIMIZER_STATE, WEIGHT

_DCP = "a DCP checkpoint"
_LIGHTNING = "a Lightning sharded checkpoint (meta.pt beside DCP's .metadata)"
_METADATA = "torch's _metadata"


def test_a_key_names_gradients_optimizer_state_or_weights():
    assert evidence(Found(GRADIENT, KEY, ("grads",), _DCP)) == "a DCP checkpoint: --key grads"
    assert evidence(Found(GRADIENT, KEY, ("model.grads",))) == "--key model.grads"
    assert evidence(Found(OPTIMIZER_STATE, KEY, ("optimizer",))) == \
        "--key optimizer: state and param_groups"
    assert evidence(Found(WEIGHT, KEY, ("model",), _DCP, "the 'model' entry, where scripts keep "
                          "the model")) == \
        "a DCP checkpoint: --key model: the 'model' entry, where scripts keep the model"


def test_a_hostile_key_is_shown_escaped():
    said = evidence(Found(GRADIENT, KEY, ("g\u202erads\x1b[31m",), _DCP))
    assert said == "a DCP checkpoint: --key g\\u202erads\\x1b[31m"


def test_entries_of_a_layout_and_of_a_plain_file():
    assert evidence(Found(GRADIENT, ENTRY, ("grads",), _DCP)) == \
        "a DCP checkpoint: its 'grads' entry"
    assert evidence(Found(WEIGHT, ENTRY, ("model",), _DCP)) == "a DCP checkpoint: its 'model' entry"
    assert evidence(Found(OPTIMIZER_STATE, ENTRY, ("optim",), _DCP)) == \
        "a DCP checkpoint: its 'optim' entry, state and param_groups"
    assert evidence(Found(OPTIMIZER_STATE, ENTRY, ("optimizer_0",), _LIGHTNING)) == \
        f"{_LIGHTNING}: its 'optimizer_0' entry, state and param_groups"
    assert evidence(Found(OPTIMIZER_STATE, ENTRY, ("optimizer_0", "optimizer_1"), _DCP)) == \
        "a DCP checkpoint: its 'optimizer_0', 'optimizer_1' entries, state and param_groups"
    # One file: a gradient key, the model's entry (with what its tensors show), optimizers.
    assert evidence(Found(GRADIENT, ENTRY, ("grads",))) == "a 'grads' key"
    assert evidence(Found(WEIGHT, ENTRY, ("model",))) == "the 'model' entry"
    assert evidence(Found(WEIGHT, ENTRY, ("net",), detail=f"a state_dict: {_METADATA}")) == \
        f"the 'net' entry: a state_dict: {_METADATA}"
    assert evidence(Found(OPTIMIZER_STATE, ENTRY, ("optimizer_g", "optimizer_d"))) == \
        "the 'optimizer_g' and 'optimizer_d' entries"


def test_marks_say_who_wrote_the_gradients():
    assert evidence(Found(GRADIENT, MARK, ("grads",))) == "gradclip's mark: save_grads wrote it"
    dumper = "OLMo-core's GradientDumperCallback"
    assert evidence(Found(GRADIENT, MARK, ("full_gradients/",), dumper,
                          "saved in pre_optim_step, the gradients the optimizer stepped on")) == (
        f"{dumper}, full_gradients/: saved in pre_optim_step, the gradients the optimizer "
        "stepped on")


def test_flat_mappings_nothing_marks():
    assert evidence(Found(GRADIENT, FLAT, detail="a flat name -> tensor mapping")) == \
        "a flat name -> tensor mapping that nothing marks as weights"
    assert evidence(Found(GRADIENT, FLAT, detail="a set of name -> tensor shards")) == \
        "a set of name -> tensor shards that nothing marks as weights"
    hf = Found(GRADIENT, UNMARKED, (), "DCP's Hugging Face layout",
               "safetensors shards with DCP_SHARDING_INFO, a flat name -> tensor set")
    said = ("DCP's Hugging Face layout: safetensors shards with DCP_SHARDING_INFO, a flat "
            "name -> tensor set that nothing marks as something else")
    # Taken as gradients and weights alike: the same evidence for both.
    assert wording(hf) == Wording(weight_evidence=said, gradient_evidence=said)


def test_what_the_tensors_show_and_a_whole_optimizer_file():
    assert evidence(Found(WEIGHT, PROOF, detail=f"a state_dict: {_METADATA}")) == \
        f"a state_dict: {_METADATA}"
    assert evidence(Found(WEIGHT, PROOF, (), "a torchtitan weights-only export",
                          "step-3/ of model tensors alone")) == \
        "a torchtitan weights-only export: step-3/ of model tensors alone"
    assert evidence(Found(OPTIMIZER_STATE, STATE)) == "a state dict with state and param_groups"


def test_a_frameworks_own_files():
    fsdp = "an accelerate FSDP checkpoint"
    assert evidence(Found(WEIGHT, FILES, ("pytorch_model_fsdp_0/",), fsdp)) == \
        f"{fsdp}: pytorch_model_fsdp_0/"
    assert evidence(Found(OPTIMIZER_STATE, FILES, ("optimizer_0/", "optimizer_1/"), fsdp)) == \
        f"{fsdp}: optimizer_0/, optimizer_1/"
    assert evidence(Found(OPTIMIZER_STATE, FILES, ("optimizer.bin",),
                          "an accelerate save_state folder")) == \
        "an accelerate save_state folder: optimizer.bin"
    # Owned by the framework: "the Trainer's optimizer.pt", with what they hold after.
    assert evidence(Found(OPTIMIZER_STATE, FILES, ("optimizer.pt",), "the Trainer's")) == \
        "the Trainer's optimizer.pt"
    assert evidence(Found(OPTIMIZER_STATE, FILES, ("recipe_state/recipe_state.pt",),
                          "torchtune's", "epochs_run 2")) == \
        "torchtune's recipe_state/recipe_state.pt, epochs_run 2"
    assert evidence(Found(WEIGHT, FILES, (".metadata's train_state.step",),
                          "a torchtitan checkpoint", "model keys at the top level")) == \
        "a torchtitan checkpoint: .metadata's train_state.step, model keys at the top level"
    assert evidence(Found(WEIGHT, FILES, ("model\n.bin",), "the Trainer's")) == \
        "the Trainer's model\\n.bin"


def test_why_no_gradients():
    path = Path("run")
    assert wording(NoGradients(path, "a Trainer checkpoint")).gradient_error == \
        f"{path}: a Trainer checkpoint holds no gradients"
    assert wording(NoGradients(path, "a verl FSDP checkpoint", (
        "model and optimizer shards", "extra state"))).gradient_error == (
        f"{path}: a verl FSDP checkpoint saves no gradients (model and optimizer shards, "
        "extra state)")
    export = "a torchtitan weights-only export (a step-N/ folder holding only the model's " \
        "state dict)"
    assert wording(NoGradients(path, export, ())).gradient_error == \
        f"{path}: {export} saves no gradients"


def test_what_is_not_gradients():
    path = Path("model.pt")
    shown = f"a state_dict: {_METADATA}"
    assert wording(NotGradients(path, WEIGHT, shown)).gradient_error == \
        f"{path}: the file is a model's weights ({shown}), not gradients"
    assert wording(NotGradients(path, WEIGHT, shown, file="the set")).gradient_error == \
        f"{path}: the set is a model's weights ({shown}), not gradients"
    assert wording(NotGradients(path, OPTIMIZER_STATE)).gradient_error == (
        f"{path}: the file is an optimizer's state dict (state and param_groups), not gradients")
    # Raw, as every refusal is built: the line is made visible once, where it is shown.
    assert wording(NotGradients(path, OPTIMIZER_STATE, key="optim\x1b")).gradient_error == (
        f"{path}: --key optim\x1b holds an optimizer's state dict (state and param_groups), "
        "not gradients")


def test_say_puts_what_is_said_in_place_and_keeps_the_rest():
    draft = Draft(path=Path("run"), kind="test")
    draft.say(wording(Found(WEIGHT, ENTRY, ("model",), _DCP)))
    draft.say(wording(Found(GRADIENT, KEY, ("grads",), _DCP), NoGradients(Path("x"), "y")))
    draft.say(wording(Found(OPTIMIZER_STATE, ENTRY, ("optim",), _DCP)))
    finished = draft.finish()
    assert dict(finished.evidence) == {
        WEIGHT: "a DCP checkpoint: its 'model' entry",
        GRADIENT: "a DCP checkpoint: --key grads",
        OPTIMIZER_STATE: "a DCP checkpoint: its 'optim' entry, state and param_groups",
    }
    assert dict(finished.missing) == {GRADIENT: f"{Path('x')}: y holds no gradients"}
