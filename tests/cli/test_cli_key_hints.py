"""What `--key` reaches and what its errors suggest: lists, flat files, optimizer state, depth."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from gradclip_cli.source.files.torch_zip_reader import read_torch_zip

from .support import ref_norm


def total(result) -> float:
    assert result.code == 0, result.err
    return result.json()["total_norm"]


def assert_one_error_line(result, path) -> str:
    assert result.code == 3
    assert result.out == ""
    assert len(result.err_lines) == 1 and "Traceback" not in result.err
    assert str(path) in result.err
    return result.err


def test_flat_file_with_a_key_says_to_omit_it(gradclip, tmp_path):
    path = tmp_path / "flat.pt"
    torch.save({"w": torch.ones(3), "b": torch.ones(2)}, path)
    err = assert_one_error_line(gradclip("inspect", path, "--key", "nope"), path)
    assert "flat name -> tensor mapping: omit --key" in err


def adamw_state(grads: dict[str, torch.Tensor]) -> dict:
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
    for p, g in zip(params, grads.values(), strict=True):
        p.grad = g.clone()
    optimizer = torch.optim.AdamW(params)
    optimizer.step()
    return optimizer.state_dict()


def test_integer_components_index_lists(gradclip, tmp_path, grads):
    # A list of gradient dicts (one per micro-batch); Lightning keeps its optimizer
    # state dicts in such a list too, and an integer part reaches either.
    path = tmp_path / "lightning_like.ckpt"
    torch.save({"optimizer_states": [adamw_state(grads)], "micro_grads": [{}, grads]}, path)
    result = gradclip("inspect", path, "--key", "micro_grads.1", "--format", "json")
    assert result.code == 0, result.err
    assert [t["name"] for t in result.json()["tensors"]] == list(grads)
    state = gradclip("inspect", path, "--key", "optimizer_states.0", "--format", "json")
    assert state.code == 0, state.err
    assert state.json()["what"] == "exp_avg"
    # Out of range: the error says what the list holds.
    err = assert_one_error_line(gradclip("inspect", path, "--key", "optimizer_states.3"), path)
    assert "no entry '3' at optimizer_states (a list of 1: positions 0 to 0)" in err


def test_list_of_gradients_is_explained_and_read_with_positions_as_names(gradclip, tmp_path):
    path = tmp_path / "listed.pt"
    tensors = [torch.full((3,), 2.0), torch.full((4,), -1.0)]
    torch.save({"grads": tensors}, path)
    err = assert_one_error_line(gradclip("inspect", path), path)
    assert "'grads' is a list of 2, not a name -> tensor mapping" in err
    assert "--key grads reads it with positions as names (0 to 1)" in err
    result = gradclip("inspect", path, "--key", "grads", "--format", "json")
    assert [t["name"] for t in result.json()["tensors"]] == ["0", "1"]
    assert total(result) == pytest.approx(ref_norm(tensors, 2), rel=1e-6)


def test_no_gradients_never_suggests_optimizer_state(gradclip, tmp_path, grads):
    path = tmp_path / "training.pt"
    model = {name: torch.randn(g.shape) for name, g in grads.items()}
    torch.save({"model": model, "optimizer": adamw_state(grads), "epoch": 3}, path)
    # --what auto measures the Adam moments where no gradients are saved (the
    # contract's default); asking for gradients gets the hints.
    assert gradclip("inspect", path, "--format", "json").json()["what"] == "exp_avg"
    err = assert_one_error_line(gradclip("inspect", path, "--what", "grads"), path)
    # Neither the weights nor the moments are offered as gradients (--key); each is
    # offered as what it is, as a --what this command measures.
    assert "candidates for --key" not in err
    assert "; no mapping in the file holds gradient-shaped tensors;" in err
    assert "it holds AdamW state (exp_avg, exp_avg_sq)" in err
    assert err.rstrip().endswith("available: --what exp_avg, --what grad_rms, --what update, "
                                 "--what weights")


def test_candidates_are_mappings_of_gradient_shaped_tensors(gradclip, tmp_path):
    path = tmp_path / "mixed.pt"
    torch.save(
        {"stats": {"loss": torch.tensor(2.5), "step": torch.tensor(3.0)},
         "ids": {"tokens": torch.arange(5)},
         "ema": {"w": torch.ones(4)}},
        path,
    )  # fmt: skip
    err = assert_one_error_line(gradclip("inspect", path), path)
    assert err.rstrip().endswith("candidates for --key: ema")


def nested(depth: int, leaf):
    for _ in range(depth):
        leaf = {"n": leaf}
    return leaf


def save_deep(obj, path) -> None:
    # torch.save pickles recursively; torch.load (an iterative unpickler) reads any depth.
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20_000))
    try:
        torch.save(obj, path)
    finally:
        sys.setrecursionlimit(limit)


DEPTH = 3000


def test_a_nesting_deeper_than_the_recursion_limit_is_read(gradclip, tmp_path):
    path = tmp_path / "deep.pt"
    leaf = torch.tensor([3.0, 4.0])
    save_deep({"grads": nested(DEPTH, {"w": leaf}), "list": nested(DEPTH, [leaf])}, path)
    assert DEPTH > sys.getrecursionlimit()
    loaded = torch.load(path, weights_only=True)  # torch reads it: so must gradclip
    result = gradclip("inspect", path, "--format", "json")
    assert total(result) == pytest.approx(5.0, rel=1e-6)
    assert result.json()["tensors"][0]["name"] == "n." * DEPTH + "w"
    assert total(gradclip("inspect", path, "--key", "list", "--format", "json")) == 5.0
    # The fast reader walks it too (no silent fall-back to torch.load), with the same result.
    fast = read_torch_zip(path)
    assert fast is not None
    node, reference = fast["list"], loaded["list"]
    for _ in range(DEPTH):
        node, reference = node["n"], reference["n"]
    assert torch.equal(node[0], reference[0])


def test_a_deep_nesting_without_gradients_is_a_clear_exit_3(gradclip, tmp_path):
    path = tmp_path / "deep_flat.pt"
    save_deep(nested(DEPTH, {"w": torch.ones(2)}), path)
    err = assert_one_error_line(gradclip("inspect", path), path)
    assert "no gradients found" in err and "Recursion" not in err


def test_deep_tuples_and_tuple_keys_in_the_fast_reader(tmp_path):
    path = tmp_path / "tuples.pt"
    leaf = torch.arange(3.0)
    chain = (leaf,)
    for _ in range(DEPTH):
        chain = (chain, 1)
    key = ("k",)
    for _ in range(DEPTH):
        key = (key,)
    save_deep({"grads": {"w": leaf}, "chain": chain, "keyed": {key: leaf}}, path)
    fast = read_torch_zip(path)
    assert fast is not None
    node = fast["chain"]
    for _ in range(DEPTH):
        node = node[0]
    assert torch.equal(node[0], leaf) and not math.isnan(node[0][0])
    (read_key,) = fast["keyed"]
    for _ in range(DEPTH):  # compared level by level: == on the tuples would recurse
        (read_key,) = read_key
    assert read_key == ("k",)


@pytest.mark.parametrize("key", ["a\\k", "a\tk"])
def test_a_key_that_needs_escapes_is_escaped_once(gradclip, tmp_path, key):
    """``--key`` echoed in its errors as every name is shown (``visible``, once): it was
    quoted with repr() and then escaped again (``'a\\\\\\\\k'`` for ``a\\k``)."""
    from gradclip_cli.escaping import visible

    path = tmp_path / "g.pt"
    torch.save({"grads": {"w": torch.ones(2)}, "x": {key: torch.ones(2)}}, path)
    for args in ((f"{key}.y",), (f"x.{key}.y",), ("x." + key,)):
        r = gradclip("inspect", path, "--key", *args)
        line = r.err_lines[-1]
        assert r.code == 3 and f"'{visible(args[0])}'" in line, line


def test_a_key_inside_optimizer_state_is_named_escaped_once(gradclip, tmp_path):
    """A ``--key`` inside an optimizer's state dict stored under a name with a backslash:
    the refusal named both through repr() and visible() before the line was escaped as a
    whole (each backslash shown four times over)."""
    from gradclip_cli.escaping import visible

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    entry = "opt\\x"
    path = tmp_path / "g.pt"
    torch.save({entry: opt.state_dict(), "model": model.state_dict()}, path)
    r = gradclip("inspect", path, "--key", f"{entry}.state")
    line = r.err_lines[-1]
    assert r.code == 3, r.err
    assert f"--key '{visible(entry + '.state')}' lies inside '{visible(entry)}'" in line, line
    assert f"(gradclip inspect --key {visible(entry)})" in line, line
    followed = gradclip("inspect", path, "--key", entry)  # the suggestion, unescaped
    assert followed.code == 0, followed.err
