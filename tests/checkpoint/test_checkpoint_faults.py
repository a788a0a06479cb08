"""Checkpoint files under hostile bytes and crashing writers.

Every single-byte corruption of a real checkpoint either loads bitwise what was saved
or raises CheckpointError; a compressed member (a zip bomb) is refused from its
header; SIGKILL mid-save never costs the last complete checkpoint and leaves no pile
of temporaries; write errors surface as the OSError they are.
"""

from __future__ import annotations

import errno
import io
import json
import os
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from repo_paths import HELPERS

import amped
from amped.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from amped.checkpoint import save_load as checkpoint_module
from amped.checkpoint.archive import ArchiveError, verify_archive

MASKS = (0x01, 0x80, 0xFF)


def real_state() -> dict[str, Any]:
    """Model, optimizer (with its 0-d step tensors), scaler and step, after one step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    optimizer = torch.optim.Adam(model.parameters())
    scaler = amped.GradScaler("cpu", hysteresis=2)
    scaler.scale(model(torch.ones(2, 4)).sum()).backward()
    scaler.step(optimizer)
    scaler.update()
    return dict(
        model=model.state_dict(),
        optimizer=optimizer.state_dict(),
        scaler=scaler.state_dict(),
        step=7,
    )


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested containers of tensors (dtype, shape, strides, bytes)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and (a.dtype, a.shape, a.stride(), a.requires_grad)
            == (b.dtype, b.shape, b.stride(), b.requires_grad)
            and torch.equal(
                a.contiguous().reshape(-1).view(torch.uint8),
                b.contiguous().reshape(-1).view(torch.uint8),
            )
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    state = real_state()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, **state)
    assert same(load_checkpoint(path), state)
    return path, state


@pytest.mark.slow
def test_every_single_byte_corruption_loads_exactly_or_raises(saved) -> None:
    """Exhaustive: every byte of the file, under each mask. ~18,000 loads, ~5 s."""
    path, state = saved
    data = path.read_bytes()
    equal, refused, silent, foreign = 0, 0, [], []
    with open(path, "r+b") as file:
        for mask in MASKS:
            for offset, byte in enumerate(data):
                file.seek(offset)
                file.write(bytes([byte ^ mask]))
                file.flush()
                try:
                    loaded = load_checkpoint(path)
                except CheckpointError:
                    refused += 1
                except Exception as error:  # what the test counts
                    foreign.append((offset, mask, repr(error)[:120]))
                else:
                    if same(loaded, state):
                        equal += 1
                    else:
                        silent.append((offset, mask))
                file.seek(offset)
                file.write(bytes([byte]))
                file.flush()
    assert silent == [] and foreign == []
    assert equal + refused == len(MASKS) * len(data)
    # Most bytes matter: only padding, timestamps and version fields may change harmlessly.
    assert refused > 2 * equal


def _central_entry(data: bytes, record: bytes) -> int:
    """The offset of the central-directory entry of the member named ``*/record``."""
    at = data.index(b"PK\x01\x02")
    while True:
        name_len = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46 : at + 46 + name_len].endswith(b"/" + record):
            return at
        at = data.index(b"PK\x01\x02", at + 4)


def test_directory_bit_in_external_attributes_is_refused(saved) -> None:
    """The flaw plain torch.load has: the member becomes a 'directory' and the tensor is
    filled from uninitialised memory. amped refuses it, naming the field."""
    path, _ = saved
    data = bytearray(path.read_bytes())
    entry = _central_entry(bytes(data), b"data/0")
    data[entry + 38] ^= 0x10  # external attributes, low byte: MS-DOS directory bit
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"external 0x10"):
        load_checkpoint(path)


class CountingReader(io.BytesIO):
    """A file that counts the bytes read from it."""

    read_bytes = 0

    def read(self, size: int | None = -1) -> bytes:  # type: ignore[override]
        data = super().read(size)
        self.read_bytes += len(data)
        return data


def zip_bomb(tmp_path: Path) -> Path:
    """torch.save's member names, with data/0 deflated: 64 MiB of zeros in ~64 KiB,
    declared 64 MiB; plus 2 MiB of stored noise, so that reading it all would show."""
    inflated = 64 << 20
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        archive.writestr("ckpt/data.pkl", b"\x80\x02}q\x00.")
        archive.writestr("ckpt/version", b"3\n")
        archive.writestr("ckpt/data/1", os.urandom(2 << 20))
        info = zipfile.ZipInfo("ckpt/data/0")
        info.compress_type = zipfile.ZIP_DEFLATED
        with archive.open(info, "w") as member:
            zeros = bytes(1 << 20)
            for _ in range(inflated >> 20):
                member.write(zeros)
    data = bytearray(buffer.getvalue())
    for record in (b"data.pkl", b"version", b"data/1", b"data/0"):
        # zipfile sets Unix permissions; torch.save writes 0, so only the method differs.
        struct.pack_into("<L", data, _central_entry(bytes(data), record) + 38, 0)
    path = tmp_path / "bomb.pt"
    path.write_bytes(bytes(data))
    return path


def test_zip_bomb_is_refused_from_its_headers(tmp_path: Path) -> None:
    """Work done, not wall time: the refusal reads the end records and the central
    directory (well under 64 KiB of a >2 MiB file) and inflates nothing."""
    path = zip_bomb(tmp_path)
    data = path.read_bytes()
    assert len(data) > 2 << 20
    reader = CountingReader(data)
    with pytest.raises(ArchiveError, match=r"'ckpt/data/0' is compressed \(method 8\)"):
        verify_archive(reader, len(data))
    assert reader.read_bytes < 64 << 10
    with pytest.raises(CheckpointError, match="compressed"):
        load_checkpoint(path)


def test_declared_size_beyond_the_file_is_refused_unread(saved) -> None:
    path, _ = saved
    data = bytearray(path.read_bytes())
    entry = _central_entry(bytes(data), b"data/0")
    struct.pack_into("<2L", data, entry + 20, 0xFFFFFFF0, 0xFFFFFFF0)  # both sizes: ~4 GiB
    reader = CountingReader(bytes(data))
    with pytest.raises(ArchiveError):
        verify_archive(reader, len(data))
    assert reader.read_bytes < len(data)


def test_checkpoint_of_another_writer_layout_is_refused(tmp_path: Path) -> None:
    """A zip that is whole but not torch.save's layout (here: a stray member)."""
    path = tmp_path / "other.pt"
    torch.save({"x": torch.ones(2)}, path)
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("other/notes.txt", b"hello")
    with pytest.raises(CheckpointError, match=r"torch\.save never writes"):
        load_checkpoint(path)


def test_plain_torch_save_files_still_load(tmp_path: Path) -> None:
    path = tmp_path / "plain.pt"
    state = real_state()
    torch.save(state, path)
    assert same(load_checkpoint(path), state)


@pytest.mark.slow
def test_repeated_sigkill_mid_save(tmp_path: Path) -> None:
    """30 children killed at random moments of back-to-back 1 MiB saves (~3 s)."""
    done = subprocess.run(
        [sys.executable, str(HELPERS / "checkpoint_kill_worker.py"), str(tmp_path), "30", "7"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    report = json.loads(done.stdout)
    killed_mid_save = 0
    for trial in report["trials"]:
        if trial["last_reported"] > 0:
            # The last save the child saw complete, or the one after it, never older.
            assert trial["last_reported"] <= trial["loaded_step"] <= trial["last_reported"] + 1
        assert trial["temporaries"] <= 1  # at most the save just killed
        killed_mid_save += trial["temporaries"]
    assert killed_mid_save >= 5, "the kills must often land inside a save"
    assert report["left_after_clean_save"] == []


def test_live_temporaries_are_left_alone(tmp_path: Path) -> None:
    """A temporary of a running save (this process, or one whose lock is held) stays."""
    own = tmp_path / f".run.pt.{os.getpid()}.abc.tmp"
    own.write_bytes(b"x")
    other = tmp_path / ".run.pt.1.abc.tmp"  # pid 1 lives; its file is fresh
    other.write_bytes(b"x")
    dead = tmp_path / ".run.pt.999999999.abc.tmp"
    dead.write_bytes(b"x")
    removed = checkpoint_module.remove_stale_temporaries(str(tmp_path), ".run.pt.")
    assert removed == [dead.name]
    assert own.exists() and other.exists() and not dead.exists()


class FullDisk(io.FileIO):
    """A file that runs out of space after ``room`` bytes."""

    room = 3000

    def write(self, data) -> int:  # type: ignore[override]
        if self.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


def test_full_disk_raises_no_space_and_keeps_the_old_checkpoint(saved, monkeypatch) -> None:
    path, state = saved
    monkeypatch.setattr(checkpoint_module.os, "fdopen", lambda handle, mode: FullDisk(handle, "wb"))
    with pytest.raises(OSError, match="No space left on device") as caught:
        save_checkpoint(path, weight=torch.zeros(10_000))
    assert caught.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert same(load_checkpoint(path), state)
    assert sorted(os.listdir(path.parent)) == ["ckpt.pt"]


FSIZE_CHILD = """
import errno, resource, signal, sys, torch
from amped.checkpoint import load_checkpoint, save_checkpoint
path = sys.argv[1]
save_checkpoint(path, step=1)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))
try:
    save_checkpoint(path, weight=torch.zeros(1 << 16), step=2)
except OSError as error:
    assert error.errno == errno.EFBIG, error
    print("EFBIG", load_checkpoint(path)["step"])
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
def test_file_size_limit_raises_efbig_and_keeps_the_old_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "run.pt"
    done = subprocess.run(
        [sys.executable, "-c", FSIZE_CHILD, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["EFBIG", "1"]
    assert os.listdir(tmp_path) == ["run.pt"]


def rebuild(data: bytes, wide: set[str]) -> bytes:
    """``data`` (a torch.save archive) rewritten the way miniz writes members of 4 GiB or
    more: 0xFFFFFFFF sizes in the central directory with a zip64 extra field holding
    the real ones, and a 24-byte data descriptor. Only the layout changes."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        members = [(info.filename, archive.read(info)) for info in archive.infolist()]
    body, directory = bytearray(), bytearray()
    for name, content in members:
        raw, offset, crc = name.encode(), len(body), zlib.crc32(content)
        body += struct.pack("<4s5H3L2H", b"PK\x03\x04", 0, 0x0808, 0, 0, 0, 0, 0, 0, len(raw), 0)
        body += raw + content
        size = len(content)
        if name in wide:
            body += struct.pack("<4sLQQ", b"PK\x07\x08", crc, size, size)
            extra, small = struct.pack("<2H2Q", 1, 16, size, size), 0xFFFFFFFF
        else:
            body += struct.pack("<4s3L", b"PK\x07\x08", crc, size, size)
            extra, small = b"", size
        directory += struct.pack(
            "<4s6H3L5H2L", b"PK\x01\x02", 0, 0, 0x0808, 0, 0, 0, crc, small, small,
            len(raw), len(extra), 0, 0, 0, 0, offset,
        )  # fmt: skip
        directory += raw + extra
    cd_offset, count = len(body), len(members)
    end64 = len(body) + len(directory)
    tail = struct.pack(
        "<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, len(directory), cd_offset
    )
    tail += struct.pack("<4sLQL", b"PK\x06\x07", 0, end64, 1)
    tail += struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, count, count, len(directory), cd_offset, 0)
    return bytes(body + directory + tail)


def test_zip64_members_as_miniz_writes_them_for_big_tensors_load(saved) -> None:
    """A checkpoint with a tensor of 4 GiB or more cannot be made in a test; its layout
    can: the same members with zip64 sizes and descriptors load, checked, as saved."""
    path, state = saved
    data = path.read_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = [n for n in archive.namelist() if "/data/" in n]
    path.write_bytes(rebuild(data, set(names[:3])))
    assert same(torch.load(path, weights_only=True), state)  # torch's reader agrees
    assert same(load_checkpoint(path), state)
    # ... and a flipped byte in a zip64 size is still caught.
    wide = bytearray(path.read_bytes())
    entry = _central_entry(bytes(wide), names[0].split("/", 1)[1].encode())
    wide[entry + 46 + struct.unpack_from("<H", wide, entry + 28)[0] + 4] ^= 0x01
    path.write_bytes(bytes(wide))
    with pytest.raises(CheckpointError):
        load_checkpoint(path)
