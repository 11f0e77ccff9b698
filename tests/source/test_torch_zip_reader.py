"""The fast zip reader: same result as torch.load(weights_only, mmap), or None."""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
import pickletools
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gradclip_cli.source.files.torch_zip_reader import read_torch_zip

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
EXTRA_FLOATS = [
    d
    for d in (getattr(torch, n, None) for n in ("float8_e4m3fn", "float8_e5m2"))
    if isinstance(d, torch.dtype)
]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
ALL = FLOATS + EXTRA_FLOATS + INTS + [torch.bool, torch.complex64, torch.uint16]


def reference(path: Path):
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def sample(dtype: torch.dtype, shape) -> torch.Tensor:
    n = math.prod(shape)
    values = (torch.arange(n) % 7 - 3).to(torch.float32) * 0.5
    if dtype == torch.bool:
        values = torch.arange(n) % 3 == 0
    elif not (dtype.is_floating_point or dtype.is_complex):
        values = torch.arange(n) % 5
    return values.reshape(shape).to(dtype)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().flatten().view(torch.uint8)


def assert_same(got, want):
    assert type(got) is type(want)
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype
        assert got.shape == want.shape
        assert got.stride() == want.stride()
        assert got.storage_offset() == want.storage_offset()
        assert got.requires_grad is want.requires_grad
        assert got.untyped_storage().nbytes() == want.untyped_storage().nbytes()
        assert torch.equal(raw_bytes(got), raw_bytes(want))
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for key in want:
            assert_same(got[key], want[key])
        if isinstance(want, OrderedDict):
            assert set(vars(got)) == set(vars(want))
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same(g, w)
    else:
        assert got == want or (got != got and want != want)


def check(tmp_path: Path, obj, name="ckpt.pt"):
    path = tmp_path / name
    torch.save(obj, path)
    got = read_torch_zip(path)
    assert got is not None
    assert_same(got, reference(path))
    return got


@pytest.mark.parametrize("dtype", ALL, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 4), (2, 0, 3), (2, 3, 4)], ids=str)
def test_dtypes_and_shapes(tmp_path, dtype, shape):
    check(tmp_path, {"t": sample(dtype, shape)})


def test_views_of_a_bigger_tensor(tmp_path):
    big = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    got = check(tmp_path, {"col": big[:, 3], "t": big.t(), "slab": big[2:4, 1:7], "big": big})
    assert got["col"].untyped_storage().data_ptr() == got["big"].untyped_storage().data_ptr()
    assert got["col"].storage_offset() == 3


def test_structures_and_plain_values(tmp_path):
    sd = OrderedDict(w=torch.ones(3), b=torch.zeros(2, dtype=torch.float16))
    sd._metadata = OrderedDict({"": {"version": 1}})
    obj = {
        "sd": sd,
        "nested": {"a": [1, 2.5, "s", None, True, False], "t": (torch.ones(1), 3, ("x", None))},
        "step": 12,
        "lr": 1e-3,
        "empty": {},
        "el": [],
        "et": (),
        "neg": -(2**40),
    }
    check(tmp_path, obj)


def test_root_can_be_a_bare_tensor_or_list(tmp_path):
    check(tmp_path, torch.randn(4, 4), "a.pt")
    check(tmp_path, [torch.randn(2), torch.randn(3)], "b.pt")


def test_ties_share_one_storage(tmp_path):
    t = torch.randn(1000)
    got = check(tmp_path, {"a": t, "b": t, "c": t[10:20]})
    assert got["a"].data_ptr() == got["b"].data_ptr()
    assert got["a"].shape == got["b"].shape and got["a"].stride() == got["b"].stride()
    assert got["c"].untyped_storage().data_ptr() == got["a"].untyped_storage().data_ptr()


def test_resaved_object_writes_each_storage_once(tmp_path):
    path = tmp_path / "many.pt"
    torch.save({f"w{i}": torch.randn(256) for i in range(40)} | {"tied": None}, path)
    got = read_torch_zip(path)
    assert got is not None
    got["tied"] = got["w0"]
    again = tmp_path / "again.pt"
    torch.save(got, again)
    original = path.stat().st_size
    assert again.stat().st_size < 2 * original
    with zipfile.ZipFile(again) as archive:
        sizes = [i.file_size for i in archive.infolist() if "/data/" in i.filename]
    assert sizes == [1024] * 40
    assert_same(reference(again), got)


def test_in_place_edit_does_not_reach_the_file(tmp_path):
    path = tmp_path / "edit.pt"
    torch.save({"a": torch.randn(5000), "b": torch.randn(3, 3)}, path)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    got = read_torch_zip(path)
    got["a"].mul_(3).add_(1)
    got["b"].zero_()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    assert torch.equal(got["b"], torch.zeros(3, 3))


# --- fallbacks -------------------------------------------------------------


def test_parameters_and_requires_grad_are_read_as_torch_reads_them(tmp_path):
    model = torch.nn.Linear(3, 2)
    got = check(tmp_path, dict(model.named_parameters()))
    assert all(type(p) is torch.nn.Parameter and p.requires_grad for p in got.values())
    frozen = torch.nn.Parameter(torch.randn(3), requires_grad=False)
    got = check(tmp_path, {"t": torch.randn(3).requires_grad_(), "frozen": frozen}, "b.pt")
    assert got["t"].requires_grad and type(got["t"]) is torch.Tensor
    assert type(got["frozen"]) is torch.nn.Parameter and not got["frozen"].requires_grad


def test_size_device_and_dtype_values_are_read(tmp_path):
    got = check(tmp_path, {"size": torch.Size([2, 3]), "dev": torch.device("cpu"),
                           "cuda": torch.device("cuda", 1), "dtype": torch.bfloat16})
    assert type(got["size"]) is torch.Size and type(got["dev"]) is torch.device


def test_set_and_bytes_fall_back(tmp_path):
    for i, value in enumerate(({1, 2}, b"raw")):
        path = tmp_path / f"v{i}.pt"
        torch.save({"v": value}, path)
        assert read_torch_zip(path) is None


@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_other_pickle_protocols_are_read(tmp_path, protocol):
    """torch's weights-only unpickler refuses 4 and 5 (FRAME, MEMOIZE); this one reads them."""
    base = torch.arange(12.0)
    obj = {"t": torch.ones(2), "view": base[2:8].view(2, 3), "base": base, "n": (1, "x", None)}
    path = tmp_path / "p.pt"
    torch.save(obj, path, pickle_protocol=protocol)
    got = read_torch_zip(path)
    assert got is not None
    # The file is the test's own: the full unpickler is a fair reference here.
    assert_same(got, torch.load(path, map_location="cpu", weights_only=False, mmap=True))
    assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()


def test_torchscript_archive_falls_back(tmp_path):
    path = tmp_path / "ts.pt"
    torch.save({"t": torch.ones(2)}, path)
    scripted = tmp_path / "ts2.pt"
    with zipfile.ZipFile(path) as old, zipfile.ZipFile(scripted, "a") as new:
        for info in old.infolist():
            new.writestr(info, old.read(info.filename))
        prefix = old.namelist()[0].split("/")[0]
        new.writestr(f"{prefix}/constants.pkl", pickle.dumps((), protocol=2))
    assert read_torch_zip(scripted) is None


def rewrite(source: Path, dest: Path, edit) -> None:
    """Copy a torch zip, passing each entry's bytes through edit(name, data)."""
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as new:
        for info in old.infolist():
            new.writestr(info.filename, edit(info.filename, old.read(info.filename)))


class _System:
    """Pickles as a call of os.system (a hostile file's payload)."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_malicious_pickle_returns_none_and_does_not_run(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    torch.save({"t": torch.ones(2)}, path)
    payload = pickle.dumps({"x": _System(f"touch {marker}")}, protocol=2)

    def edit(name, data):
        return payload if name.endswith("data.pkl") else data

    evil = tmp_path / "evil2.pt"
    rewrite(path, evil, edit)
    assert read_torch_zip(evil) is None
    assert not marker.exists()


def test_build_on_a_tensor_is_refused(tmp_path):
    """A pickle that BUILDs a loaded tensor would reach Tensor.__setstate__ (set_)."""
    path = tmp_path / "b.pt"
    torch.save({"t": torch.ones(4)}, path)
    with zipfile.ZipFile(path) as archive:
        data = next(archive.read(n) for n in archive.namelist() if n.endswith("data.pkl"))
    tensor_memo = list(_memo_puts(data))[-1]  # the REDUCE result: the tensor
    for state in (b"(K\x00K\x00K\x00K\x00t", b"}X\x01\x00\x00\x00aK\x01s"):
        tail = b"h" + bytes([tensor_memo]) + state + b"b0."
        evil = tmp_path / "b2.pt"
        rewrite(path, evil, lambda n, d, tail=tail: d[:-1] + tail if n.endswith("data.pkl") else d)
        assert read_torch_zip(evil) is None


def _memo_puts(data: bytes):
    for op, arg, _ in pickletools.genops(data):
        if op.name == "BINPUT":
            yield arg


def test_non_cpu_location_falls_back(tmp_path):
    path = tmp_path / "loc.pt"
    torch.save({"t": torch.ones(2)}, path)
    moved = tmp_path / "loc2.pt"
    rewrite(
        path,
        moved,
        lambda n, d: (
            d.replace(b"X\x03\x00\x00\x00cpu", b"X\x04\x00\x00\x00meta")
            if n.endswith("data.pkl")
            else d
        ),
    )
    assert read_torch_zip(moved) is None


def test_big_endian_falls_back(tmp_path):
    path = tmp_path / "be.pt"
    torch.save({"t": torch.ones(2)}, path)
    big = tmp_path / "be2.pt"
    rewrite(path, big, lambda n, d: b"big" if n.endswith("/byteorder") else d)
    assert read_torch_zip(big) is None


def test_compressed_entry_falls_back(tmp_path):
    path = tmp_path / "c.pt"
    torch.save({"t": torch.zeros(1000)}, path)
    squeezed = tmp_path / "c2.pt"
    with zipfile.ZipFile(path) as old, zipfile.ZipFile(squeezed, "w", zipfile.ZIP_DEFLATED) as new:
        for info in old.infolist():
            new.writestr(info.filename, old.read(info.filename))
    assert read_torch_zip(squeezed) is None


def test_short_storage_entry_falls_back(tmp_path):
    path = tmp_path / "s.pt"
    torch.save({"t": torch.ones(100)}, path)
    short = tmp_path / "s2.pt"
    rewrite(path, short, lambda n, d: d[:100] if "/data/" in n else d)
    assert read_torch_zip(short) is None


def test_view_past_its_storage_falls_back(tmp_path):
    path = tmp_path / "v.pt"
    torch.save({"t": torch.ones(4)}, path)
    # size (4,) -> (40,): BININT1 4 then TUPLE1
    bad = tmp_path / "v2.pt"
    rewrite(
        path,
        bad,
        lambda n, d: d.replace(b"K\x04\x85", b"K(\x85", 1) if n.endswith("data.pkl") else d,
    )
    assert read_torch_zip(bad) is None


def test_misaligned_entry_falls_back(tmp_path):
    path = tmp_path / "m.pt"
    torch.save({"t": torch.ones(4, dtype=torch.float64)}, path)
    # Python's zipfile writes no alignment padding: data lands wherever it lands.
    odd = tmp_path / "m2.pt"
    with zipfile.ZipFile(path) as old, zipfile.ZipFile(odd, "w") as new:
        for info in old.infolist():
            name = info.filename
            if "/data/" in name:
                new.writestr(name[: name.index("/")] + "/pad", b"x" * 3)
            new.writestr(name, old.read(name))
    with zipfile.ZipFile(odd) as archive:
        info = next(i for i in archive.infolist() if "/data/" in i.filename)
        start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    if start % 8:
        assert read_torch_zip(odd) is None
    else:  # pragma: no cover - the padding happened to align it
        assert read_torch_zip(odd) is not None


def test_not_a_zip_returns_none(tmp_path):
    path = tmp_path / "junk.pt"
    path.write_bytes(b"not a zip at all" * 10)
    assert read_torch_zip(path) is None
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    assert read_torch_zip(empty) is None


# --- random structures -----------------------------------------------------

_dtypes = st.sampled_from(FLOATS + INTS + [torch.bool])
_shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
_tensors = st.builds(sample, _dtypes, _shapes)
_plain = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**62), 2**62),
    st.floats(allow_nan=False),
    st.text(max_size=8),
)
_keys = st.text(max_size=6)
_trees = st.recursive(
    st.one_of(_tensors, _plain),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(_keys, children, max_size=4),
        st.dictionaries(_keys, children, max_size=4).map(OrderedDict),
    ),
    max_leaves=12,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(tree=_trees)
def test_random_structures_match_torch(tmp_path, tree):
    assume(tree is not None)  # a None root reads as None: "let torch.load do it"
    buffer = io.BytesIO()
    torch.save(tree, buffer)
    path = tmp_path / "h.pt"
    path.write_bytes(buffer.getvalue())
    got = read_torch_zip(path)
    assert got is not None
    assert_same(got, reference(path))


def test_more_than_65535_entries_use_the_zip64_directory(tmp_path):
    path = tmp_path / "z64.pt"
    torch.save({str(i): torch.full((1,), float(i)) for i in range(66_000)}, path)
    assert b"PK\x06\x06" in path.read_bytes()[-200:]  # zip64 end of central directory
    got = read_torch_zip(path)
    assert got is not None and len(got) == 66_000
    for i in (0, 1, 65_535, 65_999):
        assert got[str(i)].item() == float(i)


def test_a_tensor_with_attributes_is_read_as_torch_reads_it(tmp_path):
    """``_rebuild_from_type_v2``: how DeepSpeed ZeRO-3 saves its flat buffers (``ds_id``)."""
    t = torch.arange(6.0)
    t.ds_id = "0_3"
    got = check(tmp_path, {"t": t})
    assert type(got["t"]) is torch.Tensor and got["t"].ds_id == "0_3"


def test_a_tensor_attribute_that_shadows_a_member_falls_back(tmp_path):
    for i, (name, value) in enumerate((("shape", 1), ("_private", 1), ("tag", [1]))):
        t = torch.ones(2)
        t.__dict__[name] = value
        path = tmp_path / f"a{i}.pt"
        torch.save({"t": t}, path)
        assert read_torch_zip(path) is None, name


class Framework:
    """Stands for a framework class a checkpoint pickles (DeepSpeed's loss scaler)."""

    def __init__(self):
        self.scale = 2.0


def test_allowing_hands_out_a_stand_in_only_inside_the_block(tmp_path):
    from gradclip_cli.source.files.weights_pickle import Opaque, allowing

    class StandIn(Opaque):
        __slots__ = ("state",)

        def __setstate__(self, state):
            self.state = dict(state)

    path = tmp_path / "f.pt"
    torch.save({"t": torch.ones(2), "scaler": Framework()}, path)
    assert read_torch_zip(path) is None
    with allowing({(__name__, "Framework"): StandIn}):
        got = read_torch_zip(path)
    assert type(got["scaler"]) is StandIn and got["scaler"].state == {"scale": 2.0}
    assert torch.equal(got["t"], torch.ones(2))
    assert read_torch_zip(path) is None
