"""Every verdict names the quantity it judged, in every format (docs/reference/contract.md,
issue 41 item 2).

A model's ``state_dict()`` is weights, a ``torch.optim`` state is Adam's
``exp_avg`` under ``--what auto``: a verdict on either says so and never says
"gradients"; a verdict on saved gradients says "gradient". Each checkpoint is
made by the library that writes it (a real ``nn.Module``, a real
``torch.optim.Adam`` step), and each norm in a verdict is checked against a
float64 reference.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import pytest
import torch

from tests.format.test_ci_formats import parse_workflow_command

from .support import logical_lines, ref_norm, verdict

MAX_NORM = 0.5  # below every total here: each run with it fails on the threshold


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


def _weights(tmp_path, nan: bool):
    """A real ``model.state_dict()`` (torch's ``_metadata`` marks it), optionally a NaN bias."""
    model = _model()
    state = model.state_dict()
    if nan:
        state["0.bias"][2] = math.nan
    path = tmp_path / ("weights_nan.pt" if nan else "weights.pt")
    torch.save(state, path)
    return path, [t.clone() for t in state.values()]


def _exp_avg(tmp_path, nan: bool):
    """A model and its real ``torch.optim.Adam`` state after two steps: ``--what auto``
    measures the bias-corrected first moment."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).sum().backward()
        opt.step()
    state = opt.state_dict()
    if nan:
        state["state"][1]["exp_avg"][0] = math.nan
    path = tmp_path / ("adam_nan.pt" if nan else "adam.pt")
    torch.save({"model": model.state_dict(), "optimizer": state}, path)
    beta1 = opt.param_groups[0]["betas"][0]
    moments = [s["exp_avg"].double() / (1 - beta1 ** float(s["step"]))
               for s in state["state"].values()]
    return path, moments


def _grads(tmp_path, nan: bool):
    model = _model()
    model(torch.randn(4, 8)).pow(2).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    if nan:
        grads["2.weight"][0, 0] = math.nan
    path = tmp_path / ("grads_nan.pt" if nan else "grads.pt")
    torch.save({"grads": grads}, path)
    return path, list(grads.values())


MAKERS = {"weights": _weights, "exp_avg": _exp_avg, "grads": _grads}
# How each quantity is named: "non-finite {plural}", "{attribute} total norm".
NAMES = {"weights": ("weights", "weight"), "exp_avg": ("Adam exp_avg", "Adam exp_avg"),
         "grads": ("gradients", "gradient")}


def _says_only(text: str, what: str) -> None:
    """``text`` names ``what`` and, unless it is gradients, never gradients."""
    plural, attribute = NAMES[what]
    assert plural in text or attribute in text, text
    if what != "grads":
        assert "gradient" not in text.replace("no gradients saved", ""), text


def test_a_state_dict_with_a_nan_bias_is_non_finite_weights(gradclip, tmp_path):
    """The external check: ``inspect f.pt -q`` exits 1, its last stdout line names
    weights and not gradients."""
    path, _ = _weights(tmp_path, nan=True)
    r = gradclip("inspect", path, "-q")
    assert r.code == 1, r.err
    last = r.out.splitlines()[-1]
    assert "weight" in last and "gradient" not in last
    assert verdict(r.out) == ("FAIL: non-finite weights: 1 NaN, 0 +inf, 0 -inf in 1 tensor; "
                              "total norm nan (exit 1)")


@pytest.mark.parametrize("what", list(MAKERS))
@pytest.mark.parametrize("case", ["nan", "max-norm", "ok"])
def test_every_format_names_what_was_judged(gradclip, tmp_path, what, case):
    path, tensors = MAKERS[what](tmp_path, nan=case == "nan")
    args = ["inspect", path, "--no-progress"]
    if case != "ok":
        args += ["--max-norm", str(MAX_NORM)]
    code = 0 if case == "ok" else 1
    total = ref_norm(tensors, 2)
    plural, attribute = NAMES[what]
    auto_clause = (f"; --max-norm applied to the {plural} (--what auto: no gradients saved)"
                   if what != "grads" and case != "ok" else "")

    table = gradclip(*args)
    assert table.code == code, table.err
    line = verdict(table.out)
    _says_only(line, what)
    if case == "nan":
        assert line.startswith(f"FAIL: non-finite {plural}: 1 NaN, 0 +inf, 0 -inf in 1 tensor")
        assert line.endswith(f"total norm nan{auto_clause} (exit 1)")
    elif case == "max-norm":
        assert line == (f"FAIL: {attribute} total norm {total:.6g} (p=2) exceeds --max-norm "
                        f"{MAX_NORM:g}{auto_clause} (exit 1)")
    else:
        assert line == f"OK: {attribute} total norm {total:.6g} (p=2) (exit 0)"
    # The column of the largest magnitude is named for what it measured.
    header = next(row for row in table.out.splitlines() if row.startswith("┃ group"))
    assert ("max |g|" in header) == (what == "grads")
    assert ("max |w|" in header) == (what == "weights")

    quiet = gradclip(*args, "-q")
    assert quiet.code == code and verdict(quiet.out) == line

    markdown = gradclip(*args, "--format", "markdown")
    assert markdown.code == code
    shown = markdown.out.splitlines()[2]  # the bold verdict under the heading
    assert shown.startswith("**") and "exit" in shown
    _says_only(shown.replace("\\", ""), what)
    assert ("max \\|g\\|" in markdown.out) == (what == "grads")

    github = gradclip(*args, "--format", "github")
    assert github.code == code
    commands = [parse_workflow_command(x) for x in github.out.splitlines()]
    assert commands, github.out
    for kind, props, data in commands:
        assert kind == ("notice" if case == "ok" else "error")
        _says_only(props["title"], what) if kind == "error" else _says_only(data, what)
    if case == "max-norm":
        ((_, props, data),) = commands
        assert props["title"] == f"gradclip: {attribute} total norm exceeds --max-norm"
        assert data == (f"{attribute} total norm {total:.6g} > --max-norm {MAX_NORM:g}"
                        f"{auto_clause}")

    junit = gradclip(*args, "--format", "junit")
    assert junit.code == code
    root = ET.fromstring(junit.out)
    failures = root.findall(".//failure")
    assert len(failures) == (0 if case == "ok" else 1)
    for failure in failures:
        _says_only(failure.get("message"), what)
    summary = root.find("testsuite/system-out").text.splitlines()[0]
    assert summary == line  # the verdict, word for word

    doc = gradclip(*args, "--format", "json").json()
    assert doc["what"] == what
    assert doc["status"] == {"nan": "nonfinite", "max-norm": "exceeded", "ok": "ok"}[case]


def test_a_named_quantity_needs_no_word_on_auto(gradclip, tmp_path):
    """``--what weights`` named on the command line: the threshold's quantity is in the
    verdict already, and nothing is said of auto."""
    path, tensors = _weights(tmp_path, nan=False)
    r = gradclip("inspect", path, "--what", "weights", "--max-norm", MAX_NORM, "-q")
    assert r.code == 1
    assert verdict(r.out) == (f"FAIL: weight total norm {ref_norm(tensors, 2):.6g} (p=2) "
                              f"exceeds --max-norm {MAX_NORM:g} (exit 1)")


def test_ok_under_a_threshold_says_what_it_was_applied_to(gradclip, tmp_path):
    path, tensors = _exp_avg(tmp_path, nan=False)
    total = ref_norm(tensors, 2)
    r = gradclip("inspect", path, "--max-norm", total * 2, "-q")
    assert r.code == 0, r.err
    assert verdict(r.out) == (
        f"OK: Adam exp_avg total norm {total:.6g} (p=2) <= --max-norm {total * 2:.6g}; "
        "--max-norm applied to the Adam exp_avg (--what auto: no gradients saved) (exit 0)")


# -- trend and compare ------------------------------------------------------------


def _adam_run(folder, steps: int, spike: int | None = None, nan: int | None = None):
    """A real Adam run saving model and optimizer state at every step; at ``spike`` the
    loss is scaled 1e4 (the gradient, and so exp_avg, jumps); at ``nan`` an exp_avg holds
    a NaN."""
    folder.mkdir()
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    torch.manual_seed(1)
    for step in range(1, steps + 1):
        opt.zero_grad()
        loss = model(torch.randn(4, 8)).pow(2).sum()
        (loss * (1e4 if step == spike else 1.0)).backward()
        opt.step()
        state = opt.state_dict()
        if step == nan:
            state["state"][0]["exp_avg"][0, 0] = math.nan
        torch.save({"model": model.state_dict(), "optimizer": state, "step": step},
                   folder / f"step_{step}.pt")
    return folder


def test_trend_verdicts_name_adam_exp_avg(gradclip, tmp_path):
    spiking = _adam_run(tmp_path / "spike", 8, spike=8)
    r = gradclip("trend", spiking, "--no-progress")
    assert r.code == 1, r.err
    line = verdict(r.out)
    assert line.startswith("FAIL: Adam exp_avg spike at the newest point (step 8: ")
    _says_only(line, "exp_avg")
    quiet = gradclip("trend", spiking, "-q")
    assert quiet.out.splitlines() == [line]
    github = gradclip("trend", spiking, "--format", "github")
    titles = [parse_workflow_command(x)[1].get("title", "") for x in github.out.splitlines()]
    assert "gradclip: Adam exp_avg spike at step 8" in titles
    assert not any("gradient" in t for t in titles)

    broken = _adam_run(tmp_path / "nan", 7, nan=7)
    r = gradclip("trend", broken, "--no-progress")
    assert r.code == 1 and verdict(r.out).startswith(
        "FAIL: non-finite Adam exp_avg at the newest point (step 7: total norm nan")
    junit = ET.fromstring(gradclip("trend", broken, "--format", "junit").out)
    messages = [f.get("message") for f in junit.findall(".//failure")]
    assert messages and all(m == "non-finite Adam exp_avg at step 7" for m in messages)

    calm = _adam_run(tmp_path / "calm", 7)
    r = gradclip("trend", calm, "--no-progress")
    assert r.code == 0
    assert verdict(r.out) == "OK: no spike or non-finite Adam exp_avg norm at the newest point " \
                             "(exit 0)"


def test_compare_names_the_quantity_and_leads_with_the_nonfinite_group(gradclip, tmp_path):
    """A NaN norm is the largest change (docs/reference/contract.md): its group leads, in
    every format, and the verdict names it and what was measured."""
    a, _ = _weights(tmp_path, nan=False)
    b, _ = _weights(tmp_path, nan=True)
    r = gradclip("compare", a, b)
    assert r.code == 1
    rows = [row for row in r.out.splitlines() if row.startswith("│")]
    assert rows[0].split("│")[1].strip() == "0"  # the NaN group, first
    line = verdict(r.out)
    a_norm = ref_norm([t for n, t in _model().state_dict().items() if n.startswith("0.")], 2)
    assert line == f"FAIL: non-finite weight norm in 1 group(s): 0 ({a_norm:.6g} in A, nan in B) " \
                   "(exit 1)"
    doc = gradclip("compare", a, b, "--format", "json").json()
    assert doc["groups"][0]["name"] == "0" and doc["groups"][0]["b"] == "nan"
    assert [g["name"] for g in doc["groups"]] == ["0", "2"]
    markdown = gradclip("compare", a, b, "--format", "markdown").out
    body = [x for x in markdown.splitlines() if x.startswith("| ") and "---" not in x]
    assert body[1].startswith("| 0 |")  # under the header row
    github = gradclip("compare", a, b, "--format", "github").out
    errors = [parse_workflow_command(x) for x in github.splitlines()]
    assert [p["title"] for _, p, _ in errors] == ["gradclip: non-finite weights"] * 2
    assert errors[1][2] == f"0: norm {a_norm:.6g} in A, nan in B"


@pytest.mark.parametrize("b_norm", [math.inf, math.nan])
def test_compare_ranks_a_nonfinite_norm_first_whatever_its_ratio(gradclip, tmp_path, b_norm):
    """inf against inf has ratio 1 and NaN has none: either is still the largest change."""
    grads = {"a.w": torch.ones(4), "b.w": torch.ones(4), "c.w": torch.ones(4)}
    torch.save({"grads": grads}, tmp_path / "a.pt")
    changed = {"a.w": torch.ones(4) * 100, "b.w": torch.ones(4) * 3,
               "c.w": torch.tensor([1.0, 1.0, 1.0, b_norm])}
    if math.isinf(b_norm):
        grads["c.w"][0] = math.inf
        torch.save({"grads": grads}, tmp_path / "a.pt")
    torch.save({"grads": changed}, tmp_path / "b.pt")
    doc = gradclip("compare", tmp_path / "a.pt", tmp_path / "b.pt", "--format", "json").json()
    assert [g["name"] for g in doc["groups"]] == ["c", "a", "b"]
    line = logical_lines(gradclip("compare", tmp_path / "a.pt", tmp_path / "b.pt").out)[-1]
    assert line.startswith("FAIL: non-finite gradient norm in 1 group(s): c (")


def test_compare_ok_and_exceeded_name_the_quantity(gradclip, tmp_path):
    a = _adam_run(tmp_path / "run", 3)
    r = gradclip("compare", a / "step_2.pt", a / "step_3.pt", "-q")
    assert r.code == 0
    assert r.out.startswith("OK: Adam exp_avg total ratio ")
    r = gradclip("compare", a / "step_1.pt", a / "step_3.pt", "--fail-above", "1.0001", "-q")
    assert r.code == 1 and r.out.startswith("FAIL: Adam exp_avg norms: ")


@pytest.mark.parametrize("width", [80, 120])
@pytest.mark.parametrize("what", ["weights", "exp_avg"])
def test_the_last_line_names_what_was_judged(gradclip, tmp_path, monkeypatch, width, what):
    """``inspect f.pt --max-norm X -q | tail -1``, and the table's last line, name the
    quantity judged where the verdict is longer than the width (``--what auto``'s clause):
    never a tail such as "  gradients saved) (exit 1)" under a verdict on weights. Every
    line still fits the width, and the lines read back as the verdict whole."""
    monkeypatch.setenv("COLUMNS", str(width))
    path, tensors = MAKERS[what](tmp_path, nan=False)
    plural, attribute = NAMES[what]
    expected = (f"FAIL: {attribute} total norm {ref_norm(tensors, 2):.6g} (p=2) exceeds "
                f"--max-norm {MAX_NORM:g}; --max-norm applied to the {plural} (--what auto: no "
                "gradients saved) (exit 1)")
    assert len(expected) > width
    for flags in (["-q"], ["--no-progress"]):
        r = gradclip("inspect", path, "--max-norm", MAX_NORM, *flags)
        assert r.code == 1, r.err
        last = r.out.splitlines()[-1]
        assert plural in last and last.endswith("(exit 1)"), r.out
        assert max(len(line) for line in r.out.splitlines()) <= width
        assert verdict(r.out) == expected


@pytest.mark.parametrize("what", ["weights", "exp_avg"])
def test_auto_says_what_it_chose_and_why_without_a_threshold(gradclip, tmp_path, what):
    """docs/reference/contract.md: under ``--what auto`` "the report says which was used
    and why", with or without ``--max-norm``: the measured line, in every format that has
    one, and JSON's ``measured``. Named on the command line, nothing is said of auto."""
    path, _ = MAKERS[what](tmp_path, nan=False)
    why = "--what auto: no gradients saved"
    doc = gradclip("inspect", path, "--format", "json").json()
    assert doc["what"] == what and doc["measured"]["chosen"] == why
    measured = [line for line in logical_lines(gradclip("inspect", path).out)
                if line.startswith("measured: ")]
    assert measured == [f"measured: {doc['measured']['explain']} "
                        f"({doc['measured']['evidence']}); {why}"]
    junit = ET.fromstring(gradclip("inspect", path, "--format", "junit").out)
    assert measured[0] in junit.find("testsuite/system-out").text.splitlines()
    markdown = gradclip("inspect", path, "--format", "markdown").out
    assert why.replace(":", "\\:") in markdown
    named = gradclip("inspect", path, "--what", what, "--format", "json").json()
    assert "chosen" not in named["measured"]
    assert why not in gradclip("inspect", path, "--what", what).out
