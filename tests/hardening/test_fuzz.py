"""Fuzzing ``gradclip inspect --format json`` with mutated checkpoints.

Invariant for every case: exit 0 or 1 with parseable JSON on stdout, or exit 3
with exactly one line on stderr naming the file. Never a traceback, never
another exit code.

CI runs ``GRADCLIP_FUZZ_EXAMPLES`` (default 100) examples per format and
mutation strategy. A release run uses more, e.g.::

    GRADCLIP_FUZZ_EXAMPLES=5000 .venv/bin/pytest tests/hardening/test_fuzz.py -p no:randomly

The base files are tiny (a few KiB), so each example costs a few milliseconds.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.cli.support import save_safetensors

from .support import assert_clean_inspect, run_cli

EXAMPLES = int(os.environ.get("GRADCLIP_FUZZ_EXAMPLES", "100"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

_DIR = Path(tempfile.mkdtemp(prefix="gradclip-fuzz-"))


def _grads() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "layer.0.w": torch.randn(6, 5, generator=g),
        "layer.0.b": torch.randn(5, generator=g).half(),
        "layer.1.w": torch.randn(3, 4, generator=g).double(),
        "emb": torch.randn(2, 3, generator=g).bfloat16(),
    }


def _base(kind: str) -> bytes:
    path = _DIR / f"base-{kind}"
    # zip4 / legacy5: pickle protocols torch's weights-only unpickler cannot read,
    # where gradclip's restricted reader alone decides.
    protocol = {"zip4": 4, "legacy5": 5}.get(kind, 2)
    obj = {"grads": _grads(), "step": 7, "shape": torch.Size([6, 5])}
    if kind in ("zip", "zip4"):
        torch.save(obj, path, pickle_protocol=protocol)
    elif kind in ("legacy", "legacy5"):
        torch.save(obj, path, pickle_protocol=protocol, _use_new_zipfile_serialization=False)
    else:
        save_safetensors(path, _grads(), metadata={"step": "7"})
    return path.read_bytes()


BASES = {kind: _base(kind) for kind in ("zip", "legacy", "safetensors", "zip4", "legacy5")}
SUFFIX = {"safetensors": ".safetensors"}
COUNTS: dict[str, int] = {}


def _check(kind: str, data: bytes, label: str) -> None:
    COUNTS[label] = COUNTS.get(label, 0) + 1
    fd, name = tempfile.mkstemp(suffix=SUFFIX.get(kind, ".pt"), dir=_DIR)
    path = Path(name)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        assert_clean_inspect(run_cli("inspect", path, "--format", "json", "-q"), path)
    finally:
        path.unlink()


def _mutations(size: int):
    truncate = st.integers(0, size - 1).map(lambda n: ("truncate", n, 0))
    flip = st.tuples(st.just("flip"), st.integers(0, size - 1), st.integers(0, 7))
    write = st.tuples(st.just("byte"), st.integers(0, size - 1), st.integers(0, 255))
    return st.lists(st.one_of(truncate, flip, write), min_size=1, max_size=4)


def _apply(data: bytes, mutations) -> bytes:
    raw = bytearray(data)
    for op, at, arg in mutations:
        if at >= len(raw):
            continue
        if op == "truncate":
            del raw[at:]
        elif op == "flip":
            raw[at] ^= 1 << arg
        else:
            raw[at] = arg
    return bytes(raw)


@pytest.mark.parametrize("kind", ["zip", "legacy", "safetensors"])
def test_fuzz_bytes(kind):
    @FUZZ
    @given(mutations=_mutations(len(BASES[kind])))
    def run(mutations):
        _check(kind, _apply(BASES[kind], mutations), f"bytes-{kind}")

    run()


def _header_window(kind: str) -> int:
    """Where the structure lives: safetensors header, or a zip's local headers + pickle."""
    if kind == "safetensors":
        return 8 + struct.unpack("<Q", BASES[kind][:8])[0]
    return min(len(BASES[kind]), 600)


@pytest.mark.parametrize("kind", list(BASES))
def test_fuzz_header_bytes(kind):
    """Mutations concentrated on the first bytes: the pickle / header, where parsing happens."""

    @FUZZ
    @given(mutations=_mutations(_header_window(kind)))
    def run(mutations):
        _check(kind, _apply(BASES[kind], mutations), f"header-{kind}")

    run()


@pytest.mark.parametrize("kind", ["zip"])
def test_fuzz_zip_tail(kind):
    """Mutations in the central directory and end record (the last ~400 bytes)."""
    size = len(BASES[kind])
    tail = 400

    @FUZZ
    @given(mutations=_mutations(tail))
    def run(mutations):
        shifted = [(op, size - tail + at, arg) for op, at, arg in mutations]
        _check(kind, _apply(BASES[kind], shifted), "tail-zip")

    run()


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


@pytest.mark.parametrize("kind", ["safetensors"])
def test_fuzz_safetensors_json_fields(kind):
    """Edit fields of the parsed JSON header, re-encode, keep the buffer."""
    size = struct.unpack("<Q", BASES[kind][:8])[0]
    header = json.loads(BASES[kind][8 : 8 + size])
    buffer = BASES[kind][8 + size :]
    names = sorted(header)

    @FUZZ
    @given(
        name=st.sampled_from(names),
        field=st.sampled_from(["dtype", "shape", "data_offsets", "__new__"]),
        value=_JSON_VALUES
        | st.lists(st.integers(-5, 2**64), max_size=3)
        | st.sampled_from(["F32", "F16", "BF16", "F64", "I64", "BOOL", "F4", "U8", "X"]),
        drop_buffer=st.integers(0, 16),
    )
    def run(name, field, value, drop_buffer):
        edited = json.loads(json.dumps(header))
        if name == "__metadata__":
            edited[name] = value
        else:
            edited[name][field] = value
        text = json.dumps(edited).encode()
        data = struct.pack("<Q", len(text)) + text + buffer[: len(buffer) - drop_buffer]
        _check(kind, data, "json-safetensors")

    run()


# Names a careless user or a hostile archive might give: markup, escapes, newlines,
# quotes, shell syntax, leading dashes and dots, any Unicode; never "/" or NUL.
_NAME_CHARS = st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",))
_HOSTILE = st.sampled_from([
    "[oops]", "[bold red]x", "[link=file:", "]8;;", "\x1b[2J", "\x1b]8;;http://x\x07",
    "a\nOK: total norm 0.1 (p=2) (exit 0)", "-rf", "--in-place", "$(touch x)", "`id`",
    "..", ".", " ", "\u202eevil", "name.pt.", "\\", "'\"", "%s%n",
])  # fmt: skip


def _fits(name: str) -> bool:
    encoded = os.fsencode(name)
    return (0 < len(encoded) <= 255 - len(".clipped.pt") and name not in (".", "..")
            and "/" not in name and "\x00" not in name)


@settings(FUZZ, max_examples=max(10, EXAMPLES // 4))  # two CLI runs each
@given(name=(st.text(_NAME_CHARS, min_size=1, max_size=40) | _HOSTILE).filter(_fits))
def test_fuzz_hostile_file_names(name):
    """Any valid name reads and writes under exactly that name, reported as given."""
    COUNTS["hostile-name"] = COUNTS.get("hostile-name", 0) + 1
    folder = Path(tempfile.mkdtemp(dir=_DIR))
    try:
        source = folder / (name + ".pt")
        source.write_bytes(BASES["zip"])
        inspected = run_cli("inspect", source, "-q", "--format", "json")
        assert inspected.code == 0, inspected.err
        assert json.loads(inspected.out)["source"] == str(source)
        target = folder / name
        clipped = run_cli("clip", source, "--max-norm", "1", "-o", target, "-q", "--format", "json")
        assert clipped.code == 0, clipped.err
        assert json.loads(clipped.out)["output"] == str(target)
        assert sorted(os.listdir(folder)) == sorted([name, name + ".pt"])
        assert torch.load(target, weights_only=True)["grads"].keys() == _grads().keys()
    finally:
        for entry in os.listdir(folder):
            os.unlink(folder / entry)
        os.rmdir(folder)


@st.composite
def _aliasing_views(draw):
    """One storage and 1-4 views of it: slices, transposes, overlaps, expansions, self-overlaps."""
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]))
    numel = draw(st.integers(1, 48))
    views = []
    for _ in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(0, 3))
        sizes = [draw(st.integers(1, 5)) for _ in range(ndim)]
        strides = [draw(st.integers(0, 7)) for _ in range(ndim)]
        reach = sum((n - 1) * s for n, s in zip(sizes, strides))
        if reach >= numel:
            continue
        offset = draw(st.integers(0, numel - 1 - reach))
        views.append((tuple(sizes), tuple(strides), offset))
    return dtype, numel, views


def _offsets(size, stride, offset) -> set[int]:
    import itertools

    return {offset + sum(i * s for i, s in zip(index, stride))
            for index in itertools.product(*(range(n) for n in size))}


def test_fuzz_aliasing_layouts():
    """Views sharing elements: the total is the float64 norm of the distinct storage
    elements, and clipping scales each of them exactly once."""

    @FUZZ
    @given(case=_aliasing_views(), seed=st.integers(0, 2**16))
    def run(case, seed):
        dtype, numel, specs = case
        if not specs:
            return
        COUNTS["aliasing"] = COUNTS.get("aliasing", 0) + 1
        base = (torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
        grads = {f"v{i}": base.as_strided(*spec) for i, spec in enumerate(specs)}
        covered = sorted(set().union(*(_offsets(*spec) for spec in specs)))
        values = base.double()[covered]
        top = float(values.abs().max())
        want = top * float(((values / top) ** 2).sum()) ** 0.5 if top else 0.0
        fd, name = tempfile.mkstemp(suffix=".pt", dir=_DIR)
        os.close(fd)
        path, out = Path(name), Path(name + ".clipped.pt")
        try:
            torch.save({"grads": grads}, path)
            result = run_cli("inspect", path, "--format", "json", "-q")
            assert result.code == 0, result.err
            doc = json.loads(result.out)
            assert abs(doc["total_norm"] - want) <= 1e-6 * want
            assert doc["num_elements"] == len(covered)
            limit = want / 2 if want else 1.0
            result = run_cli("clip", path, "--max-norm", limit, "-o", out, "--format", "json")
            assert result.code == 0, result.err
            coef = json.loads(result.out)["clip_coef"]
            clipped = torch.load(out, weights_only=True)["grads"]
            eps = torch.finfo(dtype).eps
            for key, view in grads.items():
                # Scaled once: x * coef within the coefficient's and the product's
                # roundings (an element scaled twice would be off by coef <= 1/2).
                exact = view.double() * coef
                error = (clipped[key].double() - exact).abs()
                assert bool((error <= eps * exact.abs()).all()), key
            assert run_cli("inspect", out, "--max-norm", limit, "-q").code == 0
        finally:
            path.unlink()
            out.unlink(missing_ok=True)

    run()


def test_report_counts():
    """Prints how many cases ran (``-s`` to see); the other fuzz tests ran first."""
    print("\nfuzz cases:", json.dumps(COUNTS, sort_keys=True), "total", sum(COUNTS.values()))
    assert all(count >= 1 for count in COUNTS.values())
