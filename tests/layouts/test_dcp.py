"""DCP folders: a real 2-rank FSDP2 checkpoint, and every way a hostile one can break.

The checkpoint is written once per session by ``dcp.save`` on two spawned
gloo ranks (``dcp_ranks.py``). References never go through gradclip: torch's
own ``dcp_to_torch_save`` reassembles the full tensors, and the norms,
bias corrections and updates are computed here in float64.

Hostile copies are made by rewriting the real ``.metadata`` with torch's own
classes (the test may import them; gradclip never does), or by cutting and
pointing the real ``.distcp`` files.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from tests.cli.support import load_dcp, rel_err

from .dcp_ranks import STEPS
from .kill_clip import kill_during_clip

TOL = 1e-6  # the contract's accuracy; the references are float64


@pytest.fixture(scope="session")
def reference(dcp_checkpoint, tmp_path_factory) -> dict:
    """The whole state dict as torch's own DCP reader reassembles it."""
    return load_dcp(dcp_checkpoint, tmp_path_factory.mktemp("dcp_ref") / "full.pt")


def _norm(tensors) -> float:
    tensors = list(tensors)
    return float(torch.cat([t.double().reshape(-1) for t in tensors]).norm()) if tensors else 0.0


def _expected(reference: dict, what: str) -> dict[str, torch.Tensor]:
    """name -> the float64 tensor ``--what`` measures, from torch's reassembled state."""
    if what == "grads":
        return {n: t.double() for n, t in reference["grads"].items()}
    if what == "weights":
        return {n: t.double() for n, t in reference["model"].items()}
    return adam_measured(reference["optim"], what)


def adam_measured(optim: dict, what: str) -> dict[str, torch.Tensor]:
    """name -> the float64 ``exp_avg``, ``grad_rms`` or ``update`` of an optimizer state
    keyed by name (``get_optimizer_state_dict``'s, reassembled by torch)."""
    group = optim["param_groups"][0]
    beta1, beta2 = group["betas"]
    out = {}
    for name, state in optim["state"].items():
        step = float(state["step"])
        m = state["exp_avg"].double() / (1 - beta1**step)
        v = state["exp_avg_sq"].double() / (1 - beta2**step)
        out[name] = {"exp_avg": m, "grad_rms": v.sqrt(),
                     "update": group["lr"] * m / (v.sqrt() + group["eps"])}[what]
    return out


def test_fixture_is_sharded_by_fsdp2(dcp_checkpoint):
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(dcp_checkpoint).read_metadata()
    chunks = meta.state_dict_metadata["grads.2.weight"].chunks
    assert [tuple(c.sizes) for c in chunks] == [(2, 10), (1, 10)]
    files = {info.relative_path for info in meta.storage_data.values()}
    assert files == {"__0_0.distcp", "__1_0.distcp"}


@pytest.mark.parametrize("what", ["grads", "exp_avg", "grad_rms", "update", "weights"])
def test_every_number_against_torch_reassembled(gradclip, dcp_checkpoint, reference, what):
    expected = _expected(reference, what)
    weights = {n: t.double() for n, t in reference["model"].items()}
    result = gradclip("inspect", dcp_checkpoint, "--what", what, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["what"] == what and doc["format"] == "dcp" and doc["step"] == STEPS
    assert rel_err(doc["total_norm"], _norm(expected.values())) <= TOL
    assert doc["num_elements"] == sum(t.numel() for t in expected.values())
    rows = {t["name"]: t for t in doc["tensors"]}
    assert set(rows) == set(expected) == set(weights)
    for name, row in rows.items():
        assert rel_err(row["norm"], _norm([expected[name]])) <= TOL, name
        assert row["max_abs"] == pytest.approx(float(expected[name].abs().max()), rel=TOL)
        assert row["shape"] == list(expected[name].shape)
        if what != "weights":
            assert rel_err(row["ratio"], _norm([expected[name]]) / _norm([weights[name]])) \
                <= TOL, name


@pytest.mark.parametrize("p", ["1", "3", "inf"])
def test_other_norms(gradclip, dcp_checkpoint, reference, p):
    grads = torch.cat([t.double().reshape(-1) for t in reference["grads"].values()])
    result = gradclip("inspect", dcp_checkpoint, "--norm-type", p, "--format", "json")
    assert result.code == 0, result.err
    assert rel_err(result.json()["total_norm"], float(grads.norm(float(p)))) <= TOL


def test_auto_is_grads_and_key_reaches_any_entry(gradclip, dcp_checkpoint, reference, tmp_path):
    auto = gradclip("inspect", dcp_checkpoint, "--format", "json").json()
    assert auto["what"] == "grads"
    keyed = gradclip("inspect", dcp_checkpoint, "--key", "model", "--format", "json")
    assert keyed.code == 0, keyed.err
    assert rel_err(keyed.json()["total_norm"], _norm(reference["model"].values())) <= TOL
    # Part of the optimizer's state (one parameter's moments and its step) or of the
    # model is not gradients, as in one file: exit 3 for inspect and clip alike. inspect
    # measures the entry whole; clip offers the saved gradients' --key alone.
    meta = dcp_checkpoint / ".metadata"
    for key, entry, whole in (
            ("optim.state.0.weight", "optim", "an optimizer's state dict"),
            ("model.0", "model", "a model's weights")):
        for command, remedy in (
                (["inspect"], f"gradclip measures it whole (gradclip inspect --key {entry})"),
                (["clip", "--max-norm", "1e-9", "-o", tmp_path / "o"],
                 "clip changes saved gradients only; available: --key grads")):
            part = gradclip(*command, dcp_checkpoint, "--key", key)
            assert part.code == 3 and part.out == ""
            assert part.err_lines[0].startswith(
                f"gradclip: {meta}: --key {key!r} lies inside {entry!r}, {whole}")
            assert part.err_lines[0].endswith(f"not gradients; {remedy}"), part.err
    assert not (tmp_path / "o").exists()
    offered = gradclip("clip", dcp_checkpoint, "--key", "grads", "--max-norm", "1e-9",
                       "-o", tmp_path / "o")
    assert offered.code == 0, offered.err


@pytest.mark.parametrize(("key", "what"), [("model", "weights"), ("optim", "exp_avg")])
def test_a_key_naming_the_model_or_the_optimizer_measures_it_as_such(
        gradclip, dcp_checkpoint, reference, tmp_path, key, what):
    """The contract's --key rule: a key that names weights or optimizer state measures them
    as such, never as gradients, and clip refuses it writing nothing."""
    result = gradclip("inspect", dcp_checkpoint, "--key", key, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["what"] == what
    assert rel_err(doc["total_norm"], _norm(_expected(reference, what).values())) <= TOL
    refused = gradclip("inspect", dcp_checkpoint, "--key", key, "--what", "grads")
    assert refused.code == 3 and "not gradients" in refused.err_lines[0]
    out = tmp_path / "clipped"
    clip = gradclip("clip", dcp_checkpoint, "--key", key, "--max-norm", "0.1", "-o", out)
    assert clip.code == 3 and "clip changes saved gradients only" in clip.err
    assert not out.exists()


def test_metadata_file_given_itself(gradclip, dcp_checkpoint):
    folder = gradclip("inspect", dcp_checkpoint, "--format", "json").json()
    file = gradclip("inspect", dcp_checkpoint / ".metadata", "--format", "json")
    assert file.code == 0, file.err
    assert file.json()["total_norm"] == folder["total_norm"]


def test_table_names_the_layout(gradclip, dcp_checkpoint):
    result = gradclip("inspect", dcp_checkpoint, "--what", "exp_avg")
    assert result.code == 0, result.err
    assert ("DCP checkpoint at step 2: 20 tensors, 36 chunks, 2 files; weights, gradients, "
            "optimizer state") in result.out


def _reassembled(folder: Path, tmp_path: Path) -> dict:
    return load_dcp(folder, tmp_path / f"{folder.name}.pt")


@pytest.mark.parametrize("in_place", [False, True], ids=["output", "in-place"])
def test_clip_writes_the_set_back(gradclip, dcp_checkpoint, reference, tmp_path, in_place):
    folder = _copy(dcp_checkpoint, tmp_path)
    metadata = (folder / ".metadata").read_bytes()
    total = _norm(reference["grads"].values())
    limit = total / 4
    args = ["--in-place"] if in_place else ["-o", tmp_path / "clipped"]
    result = gradclip("clip", folder, "--max-norm", limit, *args, "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    out = folder if in_place else tmp_path / "clipped"
    assert rel_err(doc["total_norm_before"], total) <= TOL and doc["clipped"]
    assert doc["num_tensors"] == len(reference["grads"])  # tensors, not their chunks
    coef = doc["clip_coef"]
    assert coef == pytest.approx(limit / (total + 1e-6), rel=1e-6)
    # The same byte ranges: .metadata is copied as it is, every file keeps its size.
    assert (out / ".metadata").read_bytes() == metadata
    assert sorted(os.listdir(out)) == sorted(os.listdir(dcp_checkpoint))
    for name in os.listdir(out):
        assert (out / name).stat().st_size == (dcp_checkpoint / name).stat().st_size
    after = _reassembled(out, tmp_path)  # torch's own reader
    for name, grad in reference["grads"].items():
        exact = grad.double() * coef
        error = (after["grads"][name].double() - exact).abs()
        assert bool((error <= torch.finfo(torch.float32).eps * exact.abs()).all()), name
    for part in ("model", "optim", "step"):
        assert repr(after[part]) == repr(reference[part]), part
    assert gradclip("inspect", out, "--verify", "--max-norm", limit).code == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_clip_keeps_the_input_when_refusing(gradclip, dcp_checkpoint, tmp_path):
    result = gradclip("clip", dcp_checkpoint, "--max-norm", "1", "--what", "exp_avg")
    assert result.code == 2 and "clip changes gradients only" in result.err
    taken = tmp_path / "taken"
    taken.mkdir()
    result = gradclip("clip", dcp_checkpoint, "--max-norm", "1", "-o", taken)
    assert result.code == 2 and "exists" in result.err
    assert os.listdir(taken) == []


def _save_big(folder: Path) -> None:
    """A 16 MB DCP checkpoint in 4 files, written by dcp.save in this process (one rank)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    g = torch.Generator().manual_seed(5)
    grads = {f"h.{i}.w": torch.randn(500_000, generator=g) * (i + 1) for i in range(8)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"grads": grads}, storage_writer=FileSystemWriter(folder, thread_count=4))


def test_kill_9_during_clip(tmp_path):
    """Killed while the new set is written, and after: the folder is whole, old or new."""
    folder = tmp_path / "grads"
    _save_big(folder)
    assert len(list(folder.glob("*.distcp"))) == 4

    seen = kill_during_clip(
        folder, lambda f: _norm(_reassembled(f, tmp_path)["grads"].values()), half=3)
    assert seen[0].startswith("temp-appears: old set")
    assert "new set" in seen[-1]


# ------------------------------------------------------------------ hostile and broken


def _copy(dcp_checkpoint: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(dcp_checkpoint, folder)
    return folder


def _edit_metadata(folder: Path, change) -> None:
    with open(folder / ".metadata", "rb") as file:
        meta = pickle.load(file)  # the test's own fixture: torch's classes, trusted here
    change(meta)
    with open(folder / ".metadata", "wb") as file:
        pickle.dump(meta, file)


def _location(meta, fqn: str, n: int = 0):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    chunk = meta.state_dict_metadata[fqn].chunks[n]
    return MetadataIndex(fqn, chunk.offsets)


def _fails(gradclip, path: Path, named: Path, *phrases: str, what: str = "auto",
           verify: bool = False) -> str:
    result = gradclip("inspect", path, "--what", what, *(["--verify"] if verify else []))
    assert result.code == 3, (result.code, result.out, result.err)
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert str(named) in lines[0], lines[0]
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    assert "Traceback" not in result.err
    return lines[0]


def _overlap(meta):
    chunk = meta.state_dict_metadata["grads.0.weight"].chunks[1]
    chunk.offsets = torch.Size([4, 0])  # rows 4..8 over the first chunk's 0..5
    meta.storage_data = {(_relabel(k, chunk) if k.fqn == "grads.0.weight" and k.offset[0] == 5
                          else k): v for k, v in meta.storage_data.items()}


def _relabel(index, chunk):
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return MetadataIndex(index.fqn, chunk.offsets)


def _gap(meta):
    meta.state_dict_metadata["grads.0.bias"].chunks.pop()


def _past_tensor(meta):
    meta.state_dict_metadata["grads.0.bias"].chunks[1].sizes = torch.Size([7])


def _past_file_end(meta):
    info = meta.storage_data[_location(meta, "grads.2.bias", 1)]
    info.length = 10**9


def _same_bytes(meta):
    a = meta.storage_data[_location(meta, "grads.2.bias", 1)]
    b = meta.storage_data[_location(meta, "model.2.bias", 1)]
    b.relative_path, b.offset, b.length = a.relative_path, a.offset, a.length


def _no_location(meta):
    del meta.storage_data[_location(meta, "grads.0.weight", 1)]


@pytest.mark.parametrize("change, phrases", [
    (_overlap, ["'grads.0.weight'", "overlap"]),
    (_gap, ["'grads.0.bias'", "a gap"]),
    (_past_tensor, ["'grads.0.bias'", "past the tensor's size"]),
    (_same_bytes, ["overlapping bytes"]),
    (_no_location, ["'grads.0.weight'", "not where it is stored"]),
])
def test_inconsistent_metadata(gradclip, dcp_checkpoint, tmp_path, change, phrases):
    folder = _copy(dcp_checkpoint, tmp_path)
    _edit_metadata(folder, change)
    _fails(gradclip, folder, folder / ".metadata", *phrases)


def test_metadata_rewritten_in_place_is_read_again(gradclip, dcp_checkpoint, tmp_path):
    # The metadata is remembered between recognising and opening a folder: a copy rewritten
    # in place with the same size and mtime (a rewrite within the clock's granularity) must
    # be read again, not taken for the one read before.
    folder = _copy(dcp_checkpoint, tmp_path)
    assert gradclip("inspect", folder, "--format", "json").code == 0
    before = os.stat(folder / ".metadata")
    _edit_metadata(folder, _past_tensor)
    assert os.stat(folder / ".metadata").st_size == before.st_size  # the case this tests
    os.utime(folder / ".metadata", ns=(before.st_atime_ns, before.st_mtime_ns))
    _fails(gradclip, folder, folder / ".metadata", "'grads.0.bias'", "past the tensor's size")


def _many_chunks(count: int, keep):
    """``grads.0.weight`` as a [1, count] tensor in ``count`` one-element chunks (``keep``
    chooses which are listed), none of them stored anywhere."""
    def change(meta):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        entry = meta.state_dict_metadata["grads.0.weight"]
        entry.size = torch.Size([1, count])
        entry.chunks = [ChunkStorageMetadata(torch.Size([0, i]), torch.Size([1, 1]))
                        for i in range(count) if keep(i)]
        meta.storage_data = {k: v for k, v in meta.storage_data.items()
                             if k.fqn != "grads.0.weight"}
    return change


@pytest.mark.parametrize("keep, phrases", [
    (lambda i: True, ["'grads.0.weight'", "at [0, 0] but not where it is stored"]),
    (lambda i: i != 12_345, ["'grads.0.weight'", "cover 15999 of its 16000 elements"]),
])
def test_sixteen_thousand_chunks_sharing_the_first_dimension(gradclip, dcp_checkpoint, tmp_path,
                                                            keep, phrases):
    """16,000 one-element chunks that all share the first dimension (the pairwise check
    took 276 s): the tiling is judged, then the first chunk is found stored nowhere; one
    chunk missing is the gap."""
    folder = _copy(dcp_checkpoint, tmp_path)
    _edit_metadata(folder, _many_chunks(16_000, keep))
    _fails(gradclip, folder, folder / ".metadata", *phrases)


def test_chunk_past_its_files_end(gradclip, dcp_checkpoint, tmp_path):
    folder = _copy(dcp_checkpoint, tmp_path)
    _edit_metadata(folder, _past_file_end)
    _fails(gradclip, folder, folder / "__1_0.distcp", "truncated", "past its end")


def test_truncated_distcp(gradclip, dcp_checkpoint, tmp_path):
    folder = _copy(dcp_checkpoint, tmp_path)
    shard = folder / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size - 100)
    _fails(gradclip, folder, shard, "truncated")


def test_damaged_chunk(gradclip, dcp_checkpoint, tmp_path):
    """The zip end record of the last chunk of __0_0.distcp overwritten: found when read."""
    folder = _copy(dcp_checkpoint, tmp_path)
    shard = folder / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-22:] = b"\0" * 22
    shard.write_bytes(bytes(data))
    _fails(gradclip, folder, shard, "not a readable torch.save blob")


def test_verify_checks_every_chunks_crc(gradclip, dcp_checkpoint, reference, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    folder = _copy(dcp_checkpoint, tmp_path)
    meta = FileSystemReader(folder).read_metadata()
    info = meta.storage_data[_location(meta, "grads.0.weight", 1)]
    shard = folder / info.relative_path
    data = bytearray(shard.read_bytes())
    # Rows 5..10 of the gradient are the chunk's float data: flip a bit in it.
    values = reference["grads"]["0.weight"][5:].contiguous().numpy().tobytes()
    at = data.find(values, info.offset, info.offset + info.length)
    assert at > 0
    data[at + 1] ^= 0x10
    shard.write_bytes(bytes(data))
    assert gradclip("inspect", folder, "--format", "json").code == 0  # torch never checks
    _fails(gradclip, folder, shard, "checksum mismatch", what="grads", verify=True)


def test_verify_of_a_chunk_whose_zip64_record_points_past_the_end(gradclip, dcp_checkpoint,
                                                                  tmp_path):
    """A chunk's zip64 end record naming a central directory at an offset beyond any
    file: exit 3 naming the shard (zipfile raised OverflowError from the chunk's bytes)."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = _copy(dcp_checkpoint, tmp_path)
    meta = FileSystemReader(folder).read_metadata()
    info = meta.storage_data[_location(meta, "grads.0.weight", 1)]
    shard = folder / info.relative_path
    data = bytearray(shard.read_bytes())
    record = data.find(b"PK\x06\x06", info.offset, info.offset + info.length)
    assert record > 0  # torch.save writes zip64 end records
    data[record + 55] ^= 0xFF  # the top byte of the central directory's offset
    shard.write_bytes(bytes(data))
    _fails(gradclip, folder, shard, what="grads", verify=True)


def test_chunk_pointed_at_another_tensors_bytes(gradclip, dcp_checkpoint, tmp_path):
    folder = _copy(dcp_checkpoint, tmp_path)

    def swap(meta):
        a = _location(meta, "grads.0.weight", 0)
        b = _location(meta, "grads.0.bias", 0)
        meta.storage_data[a], meta.storage_data[b] = meta.storage_data[b], meta.storage_data[a]

    _edit_metadata(folder, swap)
    _fails(gradclip, folder, folder / "__0_0.distcp", "not the torch.float32 chunk [5, 6]")


@pytest.mark.parametrize("name", ["../outside.distcp", "/etc/passwd", "link.distcp"])
def test_file_outside_the_folder(gradclip, dcp_checkpoint, tmp_path, name):
    folder = _copy(dcp_checkpoint, tmp_path)
    outside = tmp_path / "outside.distcp"
    shutil.copy(folder / "__1_0.distcp", outside)
    os.symlink(outside, folder / "link.distcp")

    def point(meta):
        for info in meta.storage_data.values():
            if info.relative_path == "__1_0.distcp":
                info.relative_path = name

    _edit_metadata(folder, point)
    _fails(gradclip, folder, folder / ".metadata", "outside its folder")


def test_missing_distcp(gradclip, dcp_checkpoint, tmp_path):
    folder = _copy(dcp_checkpoint, tmp_path)
    (folder / "__1_0.distcp").unlink()
    _fails(gradclip, folder, folder / "__1_0.distcp", "missing")


class _Payload:
    """Unpickling this runs ``touch <marker>``: what a hostile .metadata does."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_metadata_with_a_code_payload(gradclip, dcp_checkpoint, tmp_path):
    marker = tmp_path / "ran"
    # The payload works: plain pickle runs it.
    pickle.loads(pickle.dumps(_Payload(marker)))
    assert marker.exists()
    marker.unlink()
    whole = _copy(dcp_checkpoint, tmp_path)
    (whole / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    _fails(gradclip, whole, whole / ".metadata", "refused", "system")
    # Hidden inside real metadata, where DCP keeps planner data.
    inner = tmp_path / "inner"
    shutil.copytree(dcp_checkpoint, inner)
    _edit_metadata(inner, lambda meta: setattr(meta, "planner_data", _Payload(marker)))
    _fails(gradclip, inner, inner / ".metadata", "refused", "system")
    assert not marker.exists()


def test_chunk_with_a_code_payload(gradclip, dcp_checkpoint, tmp_path):
    marker = tmp_path / "ran"
    folder = _copy(dcp_checkpoint, tmp_path)
    shard = folder / "__1_0.distcp"
    start = shard.stat().st_size
    with open(shard, "ab") as file:
        torch.save(_Payload(marker), file)
    length = shard.stat().st_size - start

    def point(meta):
        info = meta.storage_data[_location(meta, "grads.2.bias", 1)]
        info.relative_path, info.offset, info.length = "__1_0.distcp", start, length

    _edit_metadata(folder, point)
    _fails(gradclip, folder, shard, "refused")
    assert not marker.exists()


def test_not_metadata_at_all(gradclip, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"hello")
    _fails(gradclip, folder, folder / ".metadata", "not DCP metadata")
    (folder / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    _fails(gradclip, folder, folder / ".metadata", "not readable DCP metadata")


def test_no_gradients_says_what_is_there(gradclip, dcp_checkpoint, tmp_path):
    folder = _copy(dcp_checkpoint, tmp_path)

    def drop_grads(meta):
        for key in [k for k in meta.state_dict_metadata if k.startswith("grads.")]:
            del meta.state_dict_metadata[key]
            del meta.planner_data[key]

    _edit_metadata(folder, drop_grads)
    auto = gradclip("inspect", folder, "--format", "json")
    assert auto.code == 0, auto.err
    assert auto.json()["what"] == "exp_avg"
    assert math.isfinite(auto.json()["total_norm"])
    line = _fails(gradclip, folder, folder, "--what grads", "no gradients", what="grads")
    assert "available: --what exp_avg, --what grad_rms, --what update, --what weights" in line


@pytest.mark.parametrize("unaligned_ok", [True, False], ids=["mapped", "copied"])
def test_blob_at_an_odd_offset(tmp_path, monkeypatch, unaligned_ok):
    """A torch.save blob 3 bytes into a file (as DCP packs them): read where it lies on CPUs
    that load unaligned data, else copied aligned; the same values either way."""
    import io

    from gradclip_cli.source.files import torch_zip_reader
    from gradclip_cli.source.files.weights_pickle import Outside

    monkeypatch.setattr(torch_zip_reader, "_UNALIGNED_OK", unaligned_ok)
    value = {"w": torch.randn(7, 5, dtype=torch.float64), "b": torch.arange(6.0).half()}
    blob = io.BytesIO()
    torch.save(value, blob)
    data = blob.getvalue()
    path = tmp_path / "packed.bin"
    path.write_bytes(b"abc" + data + b"tail")
    read = torch_zip_reader.restricted_read(path, (3, len(data)))
    assert torch.equal(read["w"], value["w"]) and torch.equal(read["b"], value["b"])
    if not unaligned_ok:
        assert read["w"].data_ptr() % 8 == 0
    with pytest.raises(Outside, match="past the end"):
        torch_zip_reader.restricted_read(path, (3, len(data) + 10))


def test_a_plain_optimizer_state_dict_saved_by_dcp(gradclip, tmp_path):
    """``dcp.save`` of ``optimizer.state_dict()`` itself (no ``get_state_dict``): DCP keeps
    the state's int ids as strings ("0") beside the param groups' int ids; both are the
    same parameters, mapped to names by the model's order."""
    import warnings

    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(2):
        adam.zero_grad()
        x = torch.randn(5, 3, generator=torch.Generator().manual_seed(step))
        model(x).square().sum().backward()
        adam.step()
    state = adam.state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP saves as one process
        dcp.save({"model": model.state_dict(), "optimizer": state},
                 checkpoint_id=str(tmp_path / "ckpt"))
    expected = {name: state["state"][pid]["exp_avg"].double()
                / (1 - 0.9 ** float(state["state"][pid]["step"]))
                for pid, (name, _) in enumerate(model.named_parameters())}
    result = gradclip("inspect", tmp_path / "ckpt", "--format", "json")
    assert result.code == 0, result.err
    doc = result.json()
    assert doc["what"] == "exp_avg"
    assert rel_err(doc["total_norm"], _norm(expected.values())) <= TOL
    assert [row["name"] for row in doc["tensors"]] == list(expected)
    for row in doc["tensors"]:
        assert rel_err(row["norm"], _norm([expected[row["name"]]])) <= TOL, row["name"]


def test_a_model_and_optimizer_one_level_down_are_never_gradients(gradclip, tmp_path):
    """torch's DCP tutorial saves ``{"app": {"model": ..., "optim": ...}}``. gradclip
    reads weights and optimizer state at a DCP folder's top level only: ``app`` is no
    --key candidate, and a key that holds, names or lies inside the model or the
    optimizer is exit 3 for inspect and clip, never their tensors as gradients."""
    import warnings

    import torch.distributed.checkpoint as dcp

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).square().sum().backward()
    adam.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP saves as one process
        dcp.save({"app": {"model": model.state_dict(), "optim": adam.state_dict()}},
                 checkpoint_id=str(tmp_path / "ckpt"))
    folder, meta = tmp_path / "ckpt", tmp_path / "ckpt" / ".metadata"
    plain = gradclip("inspect", folder)
    assert plain.code == 3 and plain.err_lines == [
        f"gradclip: {meta}: no gradients (top-level keys: 'app')"]
    top_only = "not gradients; gradclip reads a DCP folder's weights and optimizer state " \
               "at its top level only"
    for key, relation, entry in (("app", "holds", "app.model"),
                                 ("app.optim", "names", "app.optim"),
                                 ("app.optim.state", "lies inside", "app.optim"),
                                 ("app.model.0.weight", "lies inside", "app.model")):
        for command in (["inspect"], ["clip", "--max-norm", "1e-9", "-o", tmp_path / "o"]):
            result = gradclip(*command, folder, "--key", key)
            assert result.code == 3 and result.out == "" and len(result.err_lines) == 1
            line = result.err_lines[0]
            assert line.startswith(f"gradclip: {meta}: --key {key!r} {relation} {entry!r}, ")
            # clip never offers weights or optimizer state: the folder saves no gradients.
            assert line.endswith(top_only if command == ["inspect"] else
                                 "not gradients; clip changes saved gradients only; "
                                 "available: none (no saved gradients found)"), line
    assert not (tmp_path / "o").exists()


def test_one_data_file_alone_names_its_folder(gradclip, dcp_checkpoint):
    """A ``.distcp`` file given alone was read as a torch zip and refused as corrupt; it is
    one of the folder's data files, which only its ``.metadata`` can place: the refusal
    says so and names the folder, and the folder, as it says, reads."""
    files = sorted(dcp_checkpoint.glob("*.distcp"))
    assert len(files) == 2
    for file in files:
        line = _fails(gradclip, file, file, f"index {dcp_checkpoint / '.metadata'}")
        assert line.endswith(f"give the folder: {dcp_checkpoint}"), line
        assert "corrupt" not in line, line
    assert gradclip("inspect", dcp_checkpoint, "--format", "json").code == 0
