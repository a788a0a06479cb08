"""A strict reader of the zip layout ``torch.save`` writes, for :func:`load_checkpoint`.

``torch.load`` trusts the archive: it checks no CRC, follows whatever the central
directory says, and treats a member whose external attributes carry the MS-DOS
directory bit as a directory (then fills the tensor from uninitialised memory). So
before torch sees a file, :func:`verify_archive` accepts only what ``torch.save``
writes, and accounts for every byte of it:

- the end-of-central-directory record at the very end, no comment, one disk; a
  zip64 end record and locator right before it when present, agreeing with it;
- local headers, data and data descriptors back to back from byte 0 up to the
  central directory, which runs exactly up to the end records;
- every member *stored* (never compressed: torch never compresses, and a compressed
  member is how a small file makes the reader decompress gigabytes), not encrypted,
  no directory entries, external and internal attributes 0, its local header and
  data descriptor agreeing with its central-directory entry, and its CRC-32 right;
- names under one top folder, each a record torch writes (``data.pkl``,
  ``version``, ``byteorder``, ``data/<n>``, ...), no duplicates.

Declared sizes are checked against the file size before anything is read, so the
work is one pass over the file, whatever the header claims. Every failure is an
:class:`ArchiveError` naming what was wrong.
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO

__all__ = ["ArchiveError", "Member", "verify_archive"]

_EOCD = struct.Struct(
    "<4s4H2LH"
)  # signature, disk, cd disk, entries here, entries, size, offset, comment
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # signature, disk of record, record offset, disks
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")  # ..., record size, made by, needed, disks, counts, cd
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # one central-directory entry, before its name
_LOCAL = struct.Struct("<4s5H3L2H")  # one local header, before its name
_MAX32, _MAX16 = 0xFFFFFFFF, 0xFFFF
_DESCRIPTOR_FLAG, _UTF8_FLAG, _ENCRYPTED_FLAG = 0x0008, 0x0800, 0x0001
_ZIP64_EXTRA, _PADDING_EXTRA = 0x0001, 0x4246  # torch pads local headers with an "FB" field
# The records torch.save writes under the archive's top folder (torch 2.4 onwards).
_RECORDS = re.compile(
    r"data\.pkl|version|\.format_version|\.storage_alignment|byteorder|data/\d+"
    r"|\.data/serialization_id|\.data/version"
)
_CHUNK = 1 << 20


class ArchiveError(ValueError):
    """The file is not an intact archive of the layout ``torch.save`` writes."""


@dataclass(frozen=True)
class Member:
    """One stored member: where its data lies and what its CRC-32 must be."""

    name: str
    data_offset: int
    size: int
    crc: int


def verify_archive(file: BinaryIO, size: int) -> list[Member]:
    """Check the archive in ``file`` (``size`` bytes) completely; return its members.

    Reads the file once (headers, then every member's data for its CRC-32).

    Raises:
        ArchiveError: anything torch.save would not have written, a CRC mismatch, or
            a truncated file.
    """
    count, cd_offset, cd_size = _read_end_records(file, size)
    members = _read_central_directory(file, cd_offset, cd_size, count)
    _check_names([member.name for member, _ in members])
    # Members lie back to back from byte 0, each ending where the next one starts (the
    # last where the central directory starts): no byte is left unchecked.
    position = 0
    ends = [member.offset for member, _ in members[1:]] + [cd_offset]
    for (member, zip64), end in zip(members, ends, strict=True):
        if member.offset != position:
            raise ArchiveError(
                f"member {member.name!r} starts at byte {member.offset}, not right after "
                f"the previous one (byte {position})"
            )
        _check_local(file, member, zip64, end)
        position = end
    return [Member(m.name, m.data_offset, m.size, m.crc) for m, _ in members]


@dataclass
class _Entry:
    name: str
    flags: int
    size: int
    crc: int
    offset: int
    data_offset: int = -1


def _read(file: BinaryIO, offset: int, length: int, what: str) -> bytes:
    file.seek(offset)
    data = file.read(length)
    if len(data) != length:
        raise ArchiveError(f"the file ends inside the {what} (truncated)")
    return data


def _read_end_records(file: BinaryIO, size: int) -> tuple[int, int, int]:
    """Entry count, central-directory offset and size (checked to end at the end records)."""
    if size < _EOCD.size:
        raise ArchiveError(f"{size} bytes is too short for a zip archive (truncated)")
    eocd_at = size - _EOCD.size
    sig, disk, cd_disk, here, count, cd_size, cd_offset, comment = _EOCD.unpack(
        _read(file, eocd_at, _EOCD.size, "end-of-central-directory record")
    )
    if sig != b"PK\x05\x06" or comment != 0:
        raise ArchiveError("no end-of-central-directory record at the end (truncated or torn)")
    if disk != 0 or cd_disk != 0 or here != count:
        raise ArchiveError("the end record describes a multi-disk archive")
    locator_at = eocd_at - _ZIP64_LOCATOR.size
    cd_end = eocd_at
    if locator_at >= 0 and _read(file, locator_at, 4, "zip64 locator") == b"PK\x06\x07":
        _, record_disk, record_at, disks = _ZIP64_LOCATOR.unpack(
            _read(file, locator_at, _ZIP64_LOCATOR.size, "zip64 locator")
        )
        cd_end = locator_at - _ZIP64_EOCD.size
        if record_disk != 0 or disks != 1 or record_at != cd_end or cd_end < 0:
            raise ArchiveError("the zip64 locator does not point right before itself")
        fields = _ZIP64_EOCD.unpack(_read(file, cd_end, _ZIP64_EOCD.size, "zip64 end record"))
        sig64, record_size, _, _, disk64, cd_disk64, here64, count64, size64, offset64 = fields
        if sig64 != b"PK\x06\x06" or record_size != _ZIP64_EOCD.size - 12:
            raise ArchiveError("malformed zip64 end-of-central-directory record")
        if disk64 != 0 or cd_disk64 != 0 or here64 != count64:
            raise ArchiveError("the zip64 end record describes a multi-disk archive")
        for short, long, limit in ((count, count64, _MAX16), (cd_size, size64, _MAX32)):
            if short not in (long, limit):
                raise ArchiveError("the zip64 end record disagrees with the end record")
        if cd_offset not in (offset64, _MAX32):
            raise ArchiveError("the zip64 end record disagrees with the end record")
        count, cd_size, cd_offset = count64, size64, offset64
    if cd_offset + cd_size != cd_end:
        raise ArchiveError(
            f"the central directory (bytes {cd_offset}+{cd_size}) does not end where the "
            f"end records begin (byte {cd_end})"
        )
    # Each entry takes at least its fixed part, so the count is bounded by the size.
    if count == 0 or count * _CENTRAL.size > cd_size:
        raise ArchiveError(f"{count} entries cannot fit a {cd_size}-byte central directory")
    return count, cd_offset, cd_size


def _read_central_directory(
    file: BinaryIO, cd_offset: int, cd_size: int, count: int
) -> list[tuple[_Entry, bool]]:
    directory = _read(file, cd_offset, cd_size, "central directory")
    entries: list[tuple[_Entry, bool]] = []
    at = 0
    for _ in range(count):
        if at + _CENTRAL.size > cd_size:
            raise ArchiveError("the central directory ends inside an entry")
        (sig, _, _, flags, method, _, _, crc, packed, size, name_len, extra_len, comment_len,
         disk, internal, external, offset) = _CENTRAL.unpack_from(directory, at)  # fmt: skip
        at += _CENTRAL.size
        name = _decode_name(directory[at : at + name_len], flags)
        extra = directory[at + name_len : at + name_len + extra_len]
        at += name_len + extra_len + comment_len
        if sig != b"PK\x01\x02" or at > cd_size:
            raise ArchiveError("malformed central-directory entry")
        _check_entry(name, flags, method, comment_len, disk, internal, external)
        # A member of 4 GiB or more has its sizes in the zip64 extra field; one that
        # starts past 4 GiB its offset. miniz then writes 8-byte sizes in its descriptor.
        zip64 = _MAX32 in (size, packed, offset)
        size, packed, offset = _zip64_sizes(name, extra, [size, packed, offset])
        if size != packed:
            raise ArchiveError(f"member {name!r} is stored but its two sizes differ")
        entries.append((_Entry(name, flags, size, crc, offset), zip64))
    if at != cd_size:
        raise ArchiveError(f"{cd_size - at} stray bytes at the end of the central directory")
    return entries


def _decode_name(raw: bytes, flags: int) -> str:
    try:
        return raw.decode("utf-8" if flags & _UTF8_FLAG else "ascii")
    except UnicodeDecodeError:
        raise ArchiveError(f"a member name is not valid text: {raw!r}") from None


def _check_entry(
    name: str, flags: int, method: int, comment: int, disk: int, internal: int, external: int
) -> None:
    if method != 0:
        raise ArchiveError(
            f"member {name!r} is compressed (method {method}); torch.save stores every member"
        )
    if flags & ~(_DESCRIPTOR_FLAG | _UTF8_FLAG):
        raise ArchiveError(f"member {name!r} has flags {flags:#06x} torch.save never sets")
    if internal or external or comment or disk:
        raise ArchiveError(
            f"member {name!r} has attributes, a comment or a disk number torch.save never "
            f"writes (internal {internal:#x}, external {external:#x})"
        )


def _zip64_sizes(name: str, extra: bytes, values: list[int]) -> list[int]:
    """Replace the 0xFFFFFFFF fields by the zip64 extra field's values, in zip order."""
    fields = dict(_extra_fields(name, extra, allowed=(_ZIP64_EXTRA,)))
    wide = fields.get(_ZIP64_EXTRA, b"")
    needed = [i for i, value in enumerate(values) if value == _MAX32]
    if len(wide) != 8 * len(needed) or (wide and not needed):
        raise ArchiveError(f"member {name!r} has a zip64 field that does not match its sizes")
    for slot, i in enumerate(needed):
        values[i] = struct.unpack_from("<Q", wide, 8 * slot)[0]
    return values


def _extra_fields(name: str, extra: bytes, allowed: tuple[int, ...]) -> list[tuple[int, bytes]]:
    fields, at = [], 0
    while at < len(extra):
        if at + 4 > len(extra):
            raise ArchiveError(f"member {name!r} has a torn extra field")
        key, length = struct.unpack_from("<2H", extra, at)
        if key not in allowed or at + 4 + length > len(extra):
            raise ArchiveError(f"member {name!r} has an extra field torch.save never writes")
        fields.append((key, extra[at + 4 : at + 4 + length]))
        at += 4 + length
    if len({key for key, _ in fields}) != len(fields):
        raise ArchiveError(f"member {name!r} repeats an extra field")
    return fields


def _check_names(names: list[str]) -> None:
    top = names[0].split("/", 1)[0]
    if len(set(names)) != len(names):
        raise ArchiveError("two members have the same name")
    for name in names:
        folder, _, record = name.partition("/")
        if folder != top or not folder or not _RECORDS.fullmatch(record):
            raise ArchiveError(
                f"member {name!r} is not a record torch.save writes under {top + '/'!r}"
            )
    for required in ("data.pkl", "version"):
        if f"{top}/{required}" not in names:
            raise ArchiveError(f"the archive has no {top}/{required} record")


def _check_local(file: BinaryIO, entry: _Entry, zip64: bool, end: int) -> None:
    """Check the local header, data (CRC-32) and descriptor of ``entry``, which must end
    exactly at byte ``end``."""
    if entry.offset + _LOCAL.size > end:
        raise ArchiveError(f"member {entry.name!r} overlaps the next record")
    (sig, _, flags, method, _, _, crc, packed, size, name_len, extra_len) = _LOCAL.unpack(
        _read(file, entry.offset, _LOCAL.size, "local header")
    )
    at = entry.offset + _LOCAL.size
    if sig != b"PK\x03\x04" or flags != entry.flags or method != 0:
        raise ArchiveError(f"the local header of {entry.name!r} disagrees with the directory")
    if at + name_len + extra_len > end:
        raise ArchiveError(f"member {entry.name!r} overlaps the next record")
    tail = _read(file, at, name_len + extra_len, "local header")
    if tail[:name_len] != entry.name.encode("utf-8"):
        raise ArchiveError(f"the local header of {entry.name!r} names another member")
    _extra_fields(entry.name, tail[name_len:], (_ZIP64_EXTRA, _PADDING_EXTRA))
    described = flags & _DESCRIPTOR_FLAG
    header_values = (crc, packed, size)
    if described and any(header_values) and header_values != (0, _MAX32, _MAX32):
        raise ArchiveError(f"the local header of {entry.name!r} has sizes and a descriptor")
    if not described and header_values not in (
        (entry.crc, entry.size, entry.size),
        (entry.crc, _MAX32, _MAX32) if zip64 else None,
    ):
        raise ArchiveError(f"the local header of {entry.name!r} disagrees with the directory")
    entry.data_offset = at + name_len + extra_len
    data_end = entry.data_offset + entry.size
    if data_end > end:
        raise ArchiveError(f"the data of {entry.name!r} runs into the next record")
    _check_crc(file, entry)
    if described:
        _check_descriptor(file, entry, data_end, end - data_end, zip64)
    elif data_end != end:
        raise ArchiveError(f"{end - data_end} stray bytes after the data of {entry.name!r}")


def _check_crc(file: BinaryIO, entry: _Entry) -> None:
    file.seek(entry.data_offset)
    crc, left = 0, entry.size
    while left:
        chunk = file.read(min(left, _CHUNK))
        if not chunk:
            raise ArchiveError(f"the file ends inside {entry.name!r} (truncated)")
        crc, left = zlib.crc32(chunk, crc), left - len(chunk)
    if crc != entry.crc:
        raise ArchiveError(f"member {entry.name!r} fails its CRC-32 check (corrupt data)")


def _check_descriptor(file: BinaryIO, entry: _Entry, at: int, length: int, zip64: bool) -> None:
    """The data descriptor at ``at``, ``length`` bytes up to the next record: 16 bytes
    with 4-byte sizes, or 24 with 8-byte ones (only for a zip64 member)."""
    layouts = {16: struct.Struct("<4s3L"), 24: struct.Struct("<4sLQQ")}
    layout = layouts.get(length)
    if layout is None or (length == 24 and not zip64):
        raise ArchiveError(f"the data descriptor of {entry.name!r} is missing or malformed")
    sig, crc, packed, size = layout.unpack(_read(file, at, length, "data descriptor"))
    if sig != b"PK\x07\x08" or (crc, packed, size) != (entry.crc, entry.size, entry.size):
        raise ArchiveError(f"the data descriptor of {entry.name!r} disagrees with the directory")
